"""The message memo (render_service/wire/message_memo.py): a render through it answers exactly what a render without it
answers, for every request: hits, misses, the same value in other bytes, errors, eviction, two threads, and
templates that try to change what it shares.

Each check renders with the memo and without it (``--render-cache-bytes 0``: no memo, the old decode path) and
compares the whole answer: through two real render servers on 127.0.0.1, and through ``render_chat`` directly for
what needs to look inside the memo."""

from __future__ import annotations

import copy
import json
import random
import threading
import tracemalloc
from typing import Any

import msgspec
import pytest

from render_service.http.errors import ApiError
from render_service.http.server import _encode_generate_request, decode
from render_service.render.render import render_chat
from render_service.render.render_config import RenderConfig, build_render_config
from render_service.templates.chat_messages import prepare_messages, prepare_tools
from render_service.templates.chat_template import template_message
from render_service.wire.message_memo import (
    KEY_HEAD_BYTES,
    KEY_TAIL_BYTES,
    MemoMessages,
    MemoTools,
    MessageMemo,
    decode_chat_request,
)
from render_service.wire.protocol import ChatCompletionRequest
from tests.conversations import BARE_TOOL, SEARCH_TOOL, UNICODE_TOOL, WEATHER_TOOL
from tests.render_harness import PARSER_FLAGS, RenderServer, qwen3_bundle

MODEL = "qwen3-0.6b"
RENDER = "/v1/chat/completions/render"
HEADERS = {"content-type": "application/json", "x-request-id": "memo-test"}
TOOLS = [WEATHER_TOOL, SEARCH_TOOL, UNICODE_TOOL, BARE_TOOL]
# A template that loops over content parts (vLLM's "openai" content format), from a client.
PARTS_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{{ p.text }}|{% endfor %}{% endif %}{% if m.tool_calls %}{{ m.tool_calls | tojson }}"
    "{% endif %}<|im_end|>\n{% endfor %}{{ tools | tojson }}"
)


def config(cache_bytes: int | None = None) -> RenderConfig:
    return build_render_config(qwen3_bundle(), served_model_names=[MODEL], trust_request_chat_template=True,
                               render_cache_bytes=cache_bytes, **PARSER_FLAGS)


@pytest.fixture(scope="module")
def servers():
    with RenderServer(config()) as memo, RenderServer(config(0)) as plain:
        yield memo, plain


# ------------------------------------------------------------------------------------------ conversations

_TEXTS = ["Hello!", "naïve café — 翻译 🌐", 'quotes " and \\ backslash', "tab\tand\nnewlines\r\n", "\u2028\u0001\x7f",
          "<|im_start|>not a marker", "", " ", "{\"json\": [1, 2]}", "x" * 300]


def _text(rng: random.Random) -> str:
    return "".join(rng.choice(_TEXTS) for _ in range(rng.randint(1, 3)))


def _message(rng: random.Random, calls: list[str]) -> dict[str, Any]:
    kind = rng.choice(["user", "user", "assistant", "assistant_calls", "tool", "system_parts", "developer"])
    if kind == "user":
        return {"role": "user", "content": _text(rng)}
    if kind == "assistant":
        message: dict[str, Any] = {"role": "assistant", "content": _text(rng)}
        if rng.random() < 0.4:
            message["reasoning_content"] = _text(rng)
        return message
    if kind == "assistant_calls":
        call_id = f"call_{rng.randrange(10**6)}"
        calls.append(call_id)
        arguments = rng.choice([json.dumps({"city": _text(rng)}), json.dumps({"query": "q"}, ensure_ascii=False),
                                "{not json", "", "[1, 2]", {"city": "Seoul"}])
        return {"role": "assistant", "content": rng.choice([None, "", _text(rng)]),
                "tool_calls": [{"id": call_id, "type": "function",
                                "function": {"name": rng.choice(["get_weather", "search_web"]), "arguments": arguments}}]}
    if kind == "tool":
        content: Any = _text(rng) if rng.random() < 0.7 else [{"type": "text", "text": _text(rng)}]
        return {"role": "tool", "tool_call_id": calls[-1] if calls else "call_0", "content": content}
    if kind == "system_parts":
        return {"role": "system", "content": [{"type": "text", "text": _text(rng)}, {"type": "text", "text": "b"}]}
    return {"role": "developer", "content": _text(rng)}


def _json(rng: random.Random, value: Any) -> str:
    """``value`` as one of several JSON texts: whitespace, key order and \\u escapes vary, the value does not."""
    return json.dumps(value, ensure_ascii=rng.random() < 0.5, sort_keys=rng.random() < 0.3,
                      separators=rng.choice([(",", ":"), (", ", ": ")]), indent=rng.choice([None, None, 1]))


def growing_bodies(seed: int, turns: int, **extra: Any) -> list[bytes]:
    """The bodies of one agent conversation turn by turn: each turn resends the earlier messages as the same bytes,
    except now and then one written differently (same value), and repeats a message now and then."""
    rng = random.Random(seed)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
    texts = [_json(rng, messages[0])]
    tools_text = _json(rng, TOOLS[:rng.randint(1, len(TOOLS))])
    calls: list[str] = []
    bodies = []
    for _ in range(turns):
        for _ in range(rng.randint(1, 3)):
            message = rng.choice(messages) if rng.random() < 0.15 else _message(rng, calls)  # a duplicate now and then
            messages.append(message)
            texts.append(_json(rng, message))
        if rng.random() < 0.2:  # an earlier message in other bytes: same value
            at = rng.randrange(len(texts))
            texts[at] = _json(rng, messages[at])
        if rng.random() < 0.1:
            tools_text = _json(rng, json.loads(tools_text))
        head = json.dumps({"model": MODEL, **extra})[:-1]
        bodies.append(f'{head}, "messages": [{", ".join(texts)}], "tools": {tools_text}}}'.encode())
    return bodies


def answer(cfg: RenderConfig, body: bytes) -> tuple[int, bytes]:
    """What the chat render job answers for ``body``: (status, JSON), as server.chat_render does."""
    try:
        req = decode_chat_request(body, cfg.message_memo, decode)
        return 200, _encode_generate_request(render_chat(req, cfg, request_id="memo-test", ids_view=True))
    except ApiError as exc:
        return exc.status, json.dumps([exc.message, exc.param]).encode()


def post(server: RenderServer, body: bytes) -> tuple[int, Any]:
    r = server.client.post(RENDER, content=body, headers=HEADERS)
    return r.status_code, r.json()


# ------------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("seed", range(3))
def test_growing_conversations_over_http_answer_as_without_the_memo(servers, seed):
    memo, plain = servers
    for body in growing_bodies(seed, 8):
        got, want = post(memo, body), post(plain, body)
        assert got == want
        assert got[0] == 200, got


def test_growing_conversations_in_process_answer_as_without_the_memo():
    on, off = config(), config(0)
    assert off.message_memo is None and on.message_memo is not None
    for seed in range(10, 22):
        extra = {"chat_template": PARTS_TEMPLATE} if seed % 3 == 0 else {}  # the "openai" content format too
        for body in growing_bodies(seed, 10, **extra):
            assert answer(on, body) == answer(off, body)
    assert on.message_memo.misses < on.message_memo.lookups / 2  # mostly hits: the test is about them


def test_the_request_decoded_through_the_memo_equals_the_usual_one():
    cfg = config()
    for body in growing_bodies(5, 6):
        for _ in range(2):  # a miss, then a hit
            req = decode_chat_request(body, cfg.message_memo, decode)
            assert type(req.messages) is MemoMessages and type(req.tools) is MemoTools
            assert msgspec.structs.asdict(req) == msgspec.structs.asdict(decode(body, ChatCompletionRequest))


def test_messages_alike_at_both_ends_and_in_length_are_told_apart():
    on, off = config(), config(0)
    ends = "a" * max(KEY_HEAD_BYTES, KEY_TAIL_BYTES)
    for middle in ("first", "other", "first", "thirD"):  # one key, three different texts
        message = {"role": "user", "content": ends + middle + ends}
        body = json.dumps({"model": MODEL, "messages": [message]}).encode()
        assert answer(on, body) == answer(off, body)
    assert on.message_memo.misses == 4 and len(on.message_memo) == 1  # each replaced the one before


def test_both_content_formats_are_prepared_from_one_entry_each_as_without_the_memo():
    cfg = config()
    body = growing_bodies(7, 4)[-1]
    req = decode_chat_request(body, cfg.message_memo, decode)
    fresh = decode(body, ChatCompletionRequest)
    for content_format in ("string", "openai", "string"):
        assert prepare_messages(req.messages, content_format) == prepare_messages(fresh.messages, content_format)
    assert prepare_tools(req.tools) == prepare_tools(fresh.tools)
    # each content format's prepared form, and beside it its template form (what a render hands the template)
    assert all(set(e.prepared) == {"string", "openai", "template:string", "template:openai"}
               for e in req.messages.entries)
    for content_format in ("string", "openai"):
        prepared = prepare_messages(req.messages, content_format)
        fresh_prepared = prepare_messages(fresh.messages, content_format)
        assert fresh_prepared.template_forms is None
        assert prepared.template_forms == [template_message(m) for m in fresh_prepared]


def test_a_message_twice_is_two_objects_to_a_template_as_without_the_memo(servers):
    memo, plain = servers
    same = {"role": "user", "content": "again"}
    template = "{% if messages[0] is sameas messages[1] %}same{% else %}apart{% endif %}"
    body = json.dumps({"model": MODEL, "messages": [same, same], "chat_template": template}).encode()
    for _ in range(2):
        got = post(memo, body)
        assert got == post(plain, body)
        assert got[0] == 200


BAD_MESSAGES = [
    '"hello"', "1", "null", "[]", '{"role": 1}', '{"content": "no role"}',
    '{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}',
    '{"role": "user", "content": {"a": 1}}', '{"role": "assistant", "tool_calls": {}}',
    '{"role": "assistant", "tool_calls": [{"type": "other"}]}', '{"role": "assistant", "reasoning": 3}',
    '{"role": "user", "content": "bad escape \\q"}', '{"role": "user", "content": "lone \\ud800"}',
    '{"role": "user", "content": ' + "[" * 2000 + "]" * 2000 + "}",
    '{"role": "user" "content": "x"}',
]
BAD_BODIES = [
    *[f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "ok"}}, {bad}]}}'.encode()
      for bad in BAD_MESSAGES],
    f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "\xff\xfe"}}]}}'.encode("latin-1"),
    f'{{"model": "{MODEL}", "messages": [1], "temperature": "hot"}}'.encode(),  # both wrong: the first is named
    f'{{"temperature": "hot", "model": "{MODEL}", "messages": [1]}}'.encode(),
    f'{{"model": "{MODEL}", "messages": {{}}}}'.encode(), b'{"messages": []}', b"[]", b"", b"{",
    f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "x"}}], "tools": {{}}}}'.encode(),
    f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "x"}}], "tools": [1]}}'.encode(),
    f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "x"}}], "tools": [{{"function": 1}}]}}'.encode(),
    f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "x"}}], "tools": [{{}}], "tool_choice": 5}}'
    .encode(),
    b'{"model": "nope", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
]


@pytest.mark.parametrize("body", BAD_BODIES, ids=range(len(BAD_BODIES)))
def test_bad_input_gets_the_same_4xx_as_without_the_memo(servers, body):
    memo, plain = servers
    for _ in range(2):  # the second time, what decoded of it is in the memo
        got = post(memo, body)
        assert got == post(plain, body)
        assert 400 <= got[0] < 500, got


def test_a_bad_message_seen_before_names_its_new_index():
    on, off = config(), config(0)
    bad = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    for at in (1, 3, 0):
        messages = [{"role": "user", "content": f"m{i}"} for i in range(4)]
        messages[at] = bad
        body = json.dumps({"model": MODEL, "messages": messages}).encode()
        got = answer(on, body)
        assert got == answer(off, body)
        assert got[0] == 400 and f"messages[{at}]".encode() in got[1]


ODD_BODIES = [
    f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "x", "role": "tool"}}]}}',  # last key wins
    f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "x"}}], "tools": null}}',
    f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "x"}}], "tools": []}}',
    f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "x"}}], "tools": null, "tools": [{json.dumps(WEATHER_TOOL)}]}}',
    f'{{"model": "{MODEL}", "messages" : [ {{ "role" : "user" , "content" : "x", "extra": {{"k": [1, 2.5e3, -0.0]}} }} ] }}',
    f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "x"}}], "messages": [{{"role": "user", "content": "y"}}]}}',
    f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "x", "n": {"[" * 500}{"]" * 500}}}]}}',
    f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "x", "big": 123456789012345678901234567890}}]}}',
]


@pytest.mark.parametrize("body", ODD_BODIES, ids=range(len(ODD_BODIES)))
def test_odd_but_valid_bodies_answer_as_without_the_memo(servers, body):
    memo, plain = servers
    for _ in range(2):
        got = post(memo, body.encode())
        assert got == post(plain, body.encode())
        assert got[0] == 200, got


MUTATING_TEMPLATES = [
    "{{ messages[0].update({'content': 'X'}) }}",
    "{{ messages[0].content.append({'type': 'text', 'text': 'X'}) }}",
    "{{ messages[0].setdefault('extra', 1) }}{{ messages[0].clear() }}{{ messages[0].pop('content') }}",
    "{{ messages[0].__setitem__('content', 'X') }}",
    "{{ tools[0].function.update({'name': 'X'}) }}",
    "{{ tools[0]['function']['parameters']['properties'].pop('city') }}",
    "{% for m in messages %}{% if m.tool_calls %}{{ m.tool_calls[0].function.arguments.update({'a': 1}) }}"
    "{% endif %}{% endfor %}",
    "{% set ns = namespace(m=messages[0]) %}{% set ns.m.content = 'X' %}{{ ns.m }}",
    "{{ messages[1].tool_calls.append(1) }}{{ messages[1].tool_calls.reverse() }}",
]


def test_a_template_cannot_change_what_the_memo_shares(servers):
    memo, plain = servers
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "a"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    body = json.dumps({"model": MODEL, "messages": messages, "tools": [WEATHER_TOOL]}).encode()
    want = post(plain, body)
    assert post(memo, body) == want
    for source in MUTATING_TEMPLATES:
        attempt = json.dumps({"model": MODEL, "messages": messages, "tools": [WEATHER_TOOL],
                              "chat_template": source + PARTS_TEMPLATE}).encode()
        got = post(memo, attempt)
        assert got == post(plain, attempt)
        assert got[0] == 400, (source, got)
        assert post(memo, body) == want  # the next render still sees the conversation as sent

    # and what the memo holds is as it was (in process: the entries themselves)
    cfg = config()
    answer(cfg, body)
    parts = json.dumps({"model": MODEL, "messages": messages, "tools": [WEATHER_TOOL],
                        "chat_template": PARTS_TEMPLATE}).encode()
    assert answer(cfg, parts)[0] == 200  # both content formats prepared
    memo_entries = [e for e, _ in cfg.message_memo._entries.values()]
    before = copy.deepcopy([(e.value, e.prepared) for e in memo_entries])
    for source in MUTATING_TEMPLATES:
        attempt = json.dumps({"model": MODEL, "messages": messages, "tools": [WEATHER_TOOL],
                              "chat_template": source + PARTS_TEMPLATE}).encode()
        assert answer(cfg, attempt)[0] == 400
    assert [(e.value, e.prepared) for e in memo_entries] == before


def test_a_tiny_budget_evicts_and_still_answers_as_without_the_memo():
    on, off = config(8 * 8192), config(0)  # a memo under 8 KiB: an entry or two
    memo = on.message_memo
    assert on.caches is not None and memo.max_bytes == on.caches.shares.memo <= 8192
    for body in growing_bodies(31, 12):
        assert answer(on, body) == answer(off, body)
        assert 0 < memo.bytes <= memo.max_bytes
    assert len(memo) < 6 and memo.misses > 30


def test_an_evicted_entry_takes_back_the_tojson_texts_it_lent():
    from render_service.templates.tojson_cache import DEFAULT_TEXTS

    cfg = config(8 * 8192)
    memo = cfg.message_memo
    lent_before: dict[int, Any] = {}  # (the values held: their ids stay theirs)
    for body in growing_bodies(33, 12):
        answer(cfg, body)
        live = [v for e, _ in memo._entries.values() for v in e.lent]
        lent_before.update((id(v), v) for v in live)
        for value in live:  # every value a kept entry lent is written by identity, as json.dumps writes it
            assert DEFAULT_TEXTS._lent[id(value)] == (value, json.dumps(value, ensure_ascii=False))
    assert lent_before, "no tool call arguments or tools were lent"
    kept = {id(v) for e, _ in memo._entries.values() for v in e.lent}
    gone = [v for key, v in lent_before.items() if key not in kept]
    assert gone and all(DEFAULT_TEXTS._lent.get(id(v), (None,))[0] is not v for v in gone)


def test_two_threads_sharing_a_small_memo_answer_as_without_it():
    on, off = config(8 * 64 * 1024), config(0)
    work = {seed: growing_bodies(seed, 8) for seed in (41, 42, 43, 44)}
    want = {seed: [answer(off, body) for body in bodies] for seed, bodies in work.items()}
    got: dict[int, list[tuple[int, bytes]]] = {}

    def run(seed: int) -> None:
        got[seed] = [answer(on, body) for body in work[seed] * 2]

    threads = [threading.Thread(target=run, args=(seed,)) for seed in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {seed: w * 2 for seed, w in want.items()}


def test_a_zero_budget_means_no_memo_and_the_usual_decode():
    cfg = config(0)
    assert cfg.message_memo is None
    body = growing_bodies(3, 2)[-1]
    req = decode_chat_request(body, cfg.message_memo, decode)
    assert type(req.messages) is list and type(req.tools) is list


def test_the_size_estimate_covers_what_an_entry_holds():
    memo = MessageMemo(1 << 30)
    bodies = growing_bodies(51, 12)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for body in bodies:
            req = memo.decode_chat(body)
            assert req is not None
            prepare_messages(req.messages, "string")
            prepare_tools(req.tools)
        del req
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held <= memo.bytes <= 3 * held


def test_nesting_at_the_decoders_depth_limit_is_decoded_as_without_the_memo():
    memo = config().message_memo

    def body(depth: int) -> bytes:
        return (f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "x", "n": '
                + "[" * depth + "]" * depth + "}]}").encode()

    def decoded(memo: MessageMemo | None, depth: int) -> Any:
        try:
            return msgspec.structs.asdict(decode_chat_request(body(depth), memo, decode))
        except ApiError as exc:
            return exc.status, exc.message, exc.param

    depth, deepest = 1, 100_000  # the deepest the plain decode takes, found by halving
    while depth < deepest:
        mid = (depth + deepest + 1) // 2
        if isinstance(decoded(None, mid), dict):
            depth = mid
        else:
            deepest = mid - 1
    for n in range(depth - 3, depth + 4):
        assert decoded(memo, n) == decoded(None, n)
    assert decoded(memo, depth + 1)[0] == 400


def test_a_growing_body_takes_its_earlier_messages_prepared_as_the_body_before_left_them():
    """Bodies over the body store's floor: each turn's preparation starts from the list the previous turn's left on
    its stored body (the developer role among the kept messages still found), and equals a fresh preparation;
    the render answers as without the memo, a repeated message included."""
    on, off = config(), config(0)
    memo = on.message_memo
    assert memo is not None and memo.bodies is not None
    long = "word " * (memo.bodies.base // 4)
    messages: list[dict[str, Any]] = [{"role": "developer", "content": "Be brief."},
                                      {"role": "user", "content": long}]
    for turn in range(6):
        messages += [{"role": "assistant", "content": f"answer {turn}"}, {"role": "user", "content": f"more {turn}"}]
        if turn == 3:
            messages.append(messages[2])  # the same message again: two objects to a template, no list filed
        body = json.dumps({"model": MODEL, "messages": messages}).encode()
        assert answer(on, body) == answer(off, body)
        req = decode_chat_request(body, memo, decode)
        assert type(req.messages) is MemoMessages and req.messages.filed is not None
        if turn > 0:
            assert req.messages.shared_with is not None and req.messages.shared_with[1] >= 2
        prepared = prepare_messages(req.messages, "string")
        assert prepared == prepare_messages(decode(body, ChatCompletionRequest).messages, "string")
        assert prepared.has_developer is True
        assert ("string" in req.messages.filed.prepared) == (turn < 3)  # (from turn 3 on, the repeat is in)
