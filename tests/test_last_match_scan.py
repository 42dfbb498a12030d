"""Head scans for the last matching message (templates/last_match_scan.py): which loops are taken over, and that a
render answering them from a record renders what a full render does, whatever the conversation and however it
changed since the record."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from bench.agent_trace import AgentTraceSpec, agent_trace, round_ends
from render_service.templates.chat_messages import prepare_messages, prepare_tools
from render_service.templates.chat_template import ChatTemplate, PlainMessages
from render_service.templates.last_match_scan import find_last_match_scans
from render_service.templates.sandbox import _ENVIRONMENT
from tests.render_harness import QWEN3_DIR

QWEN3 = json.loads((QWEN3_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))["chat_template"]

# The shape Qwen3 writes, with a flag a request sets (``start``) and the answer printed where the loop reads it.
SCAN = (
    "{%- set ns = namespace(go=start, at=-1) %}"
    "{%- for m in messages[::-1] %}"
    "{%- set i = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.go and m.role == 'user' and m.content is string and not m.content.startswith('tool:') %}"
    "{%- set ns.go = false %}{%- set ns.at = i %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}{{ m.role }}:{{ m.content }}{{ '*' if loop.index0 == ns.at }}|{%- endfor %}"
    "[{{ ns.at }}]"
)


def _shared(messages: list[dict[str, Any]]) -> PlainMessages:
    out = PlainMessages(messages)
    out.shared = True  # as the message memo hands them out: the same objects for every request that carries them
    return out


def _scans(source: str) -> list[tuple[str, str, str]]:
    return [(s.namespace, s.flag, s.found) for s in find_last_match_scans(_ENVIRONMENT.parse(source))]


def test_the_scan_qwen3_and_its_family_write_is_recognised():
    assert _scans(QWEN3) == [("ns", "multi_step_tool", "last_query_index")]
    assert _scans(SCAN) == [("ns", "go", "at")]


HEAD = "{%- set ns = namespace(go=true, at=-1) %}"
BODY = ("{%- set i = (messages|length - 1) - loop.index0 %}"
        "{%- if ns.go and COND %}{%- set ns.go = false %}{%- set ns.at = i %}{%- endif %}")
LOOP = "{%- for m in messages[::-1] %}" + BODY + "{%- endfor %}{{ ns.at }}"


@pytest.mark.parametrize("source", [
    LOOP.replace("COND", "m.role == loop.length"),  # a loop counter that depends on the conversation's length
    LOOP.replace("COND", "m.role == other"),  # a name besides the message
    LOOP.replace("COND", "m.role == ns.at"),  # the namespace itself
    LOOP.replace("COND", "m.content.pop()"),  # a method that changes what it reads
    LOOP.replace("COND", "m.role|map('upper')"),  # a filter not known to be pure
    LOOP.replace("COND", "m.role == 'user'").replace("{%- endif %}", "{%- endif %}x"),  # the loop writes
    LOOP.replace("COND", "m.role == 'user'").replace("set ns.go = false", "set ns.go = true"),
    LOOP.replace("COND", "m.role == 'user'").replace("set ns.at = i", "set ns.at = i + 1"),
    LOOP.replace("COND", "m.role == 'user'").replace("messages[::-1]", "messages"),  # a forward loop
    LOOP.replace("COND", "m.role == 'user'").replace("messages[::-1]", "messages[1:][::-1]"),
    LOOP.replace("COND", "m.role == 'user'").replace("(messages|length - 1) - loop.index0", "loop.index0"),
    "{%- set messages = messages[1:] %}" + LOOP.replace("COND", "m.role == 'user'"),  # its own messages
    "{%- macro f() %}" + LOOP.replace("COND", "m.role == 'user'") + "{%- endmacro %}{{ f() }}",  # not top level
])
def test_loops_of_any_other_shape_are_left_as_written(source):
    assert _scans(HEAD + source) == []


def _grow(resumed: ChatTemplate, plain: ChatTemplate, conversation: list[dict[str, Any]], ends: list[int],
          kwargs: dict[str, Any]) -> None:
    for end in ends:
        head = _shared(conversation[:end])
        assert resumed.render(head, **kwargs) == plain.render(head, **kwargs), end


def test_a_growing_agent_conversation_scans_only_its_new_messages():
    messages, tools = agent_trace(AgentTraceSpec(rounds=12))
    prepared, kwargs = prepare_messages(messages), {"tools": prepare_tools(tools), "add_generation_prompt": True}
    resumed, plain = ChatTemplate(QWEN3), ChatTemplate(QWEN3, loop_record_bytes=0)
    assert resumed.loop_records is not None
    ends = round_ends(prepared)
    _grow(resumed, plain, prepared, ends, kwargs)
    assert resumed.loop_records.scans_shortened == len(ends) - 1  # every turn after the first


def _random_message(rng: random.Random, i: int) -> dict[str, Any]:
    role = rng.choice(["user", "user", "assistant", "tool", "system"])
    content = rng.choice([f"q{i}", f"tool: {i}", f"<tool_response>r{i}</tool_response>", ""])
    return {"role": role, "content": content}


@pytest.mark.parametrize("source", [SCAN, QWEN3], ids=["scan", "qwen3"])
def test_random_conversations_grown_and_changed_render_as_full_renders(source):
    """User queries anywhere (or nowhere), grown a message at a time; then one message replaced (the extend's probe,
    which can move the last match past the messages shared with the record); the flag clear at the start too."""
    resumed, plain = ChatTemplate(source), ChatTemplate(source, loop_record_bytes=0)
    assert resumed.loop_records is not None
    rng = random.Random(7)
    for round_ in range(40):
        messages = prepare_messages([_random_message(rng, i) for i in range(rng.randint(1, 12))])
        kwargs = {"start": round_ % 4 != 3, "add_generation_prompt": True}
        _grow(resumed, plain, messages, list(range(1, len(messages) + 1)), kwargs)
        k = rng.randrange(len(messages))
        changed = PlainMessages([*messages[:k], *prepare_messages([_random_message(rng, 99)]), *messages[k + 1:]])
        assert resumed.render(changed, **kwargs) == plain.render(changed, **kwargs), k
    assert resumed.loop_records.scans_shortened > 0


def test_a_scan_whose_flag_is_clear_at_the_start_takes_no_answer_from_a_record():
    resumed, plain = ChatTemplate(SCAN), ChatTemplate(SCAN, loop_record_bytes=0)
    assert resumed.loop_records is not None
    messages = prepare_messages([{"role": "user", "content": "q0"}, {"role": "assistant", "content": "a"},
                                 {"role": "tool", "content": "tool: r"}, {"role": "assistant", "content": "b"}])
    for start in (True, False, True):
        _grow(resumed, plain, messages, [1, 2, 3, 4], {"start": start})
    assert resumed.render(_shared(messages), start=False).endswith("[-1]")
    assert resumed.render(_shared(messages), start=True).endswith("[0]")
