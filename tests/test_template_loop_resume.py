"""A conversation that grew renders only its new messages (templates/loop_resume.py): the message loop resumes from
the record of a recent render of the same leading messages. Every render here is compared with the same template
rendering without records; the resumed ones must be byte-identical, and the tests check that they were resumed
(the records' hit count), so an equality that only holds because nothing was resumed does not pass."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from bench.agent_trace import AgentTraceSpec, agent_trace, round_ends
from render_service.templates.chat_messages import prepare_messages, prepare_tools
from render_service.templates.chat_template import ChatTemplate, PlainMessages
from render_service.templates.loop_plan import plan_message_loop
from render_service.templates.sandbox import _ENVIRONMENT
from tests.conversations import CONVERSATIONS, template_inputs
from tests.render_harness import QWEN3_DIR

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = sorted([*(ROOT / "tests" / "fixtures" / "templates").glob("*.jinja"),
                    *(ROOT / "render_service" / "bundle").glob("*.jinja"),
                    ROOT / "tests" / "fixtures" / "qwen2_5_vl" / "chat_template.jinja"])
QWEN3 = json.loads((QWEN3_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))["chat_template"]


def _shared(messages: list[dict[str, Any]]) -> PlainMessages:
    """Messages as the message memo hands them out: the same objects for every request that carries them."""
    out = PlainMessages(messages)
    out.shared = True
    return out


def _pair(source: str) -> tuple[ChatTemplate, ChatTemplate]:
    return ChatTemplate(source), ChatTemplate(source, loop_record_bytes=0)


def _grow(resumed: ChatTemplate, plain: ChatTemplate, messages: list[dict[str, Any]], kwargs: dict[str, Any],
          ends: list[int]) -> int:
    """Renders ``messages[:end]`` for each end with both templates; asserts equal text; how many were resumed."""
    assert resumed.loop_records is not None
    before = resumed.loop_records.resumed
    for end in ends:
        head = _shared(messages[:end])
        try:
            expected = plain.render(head, **kwargs)
        except Exception:
            with pytest.raises(Exception):  # noqa: B017 - the template's own refusal, whatever it is
                resumed.render(head, **kwargs)
            continue
        assert resumed.render(head, **kwargs) == expected, end
    return resumed.loop_records.resumed - before


def _grow_trace_a_message_at_a_time(source: str, rounds: int, kwargs: dict[str, Any]
                                    ) -> tuple[ChatTemplate, ChatTemplate, list[dict[str, Any]]]:
    """An agent trace grown one message at a time through ``source`` with and without records: equal text, and
    every render after the first resumed. The templates and the trace's messages."""
    resumed, plain = _pair(source)
    messages = prepare_messages(agent_trace(AgentTraceSpec(rounds=rounds))[0])
    ends = list(range(2, len(messages) + 1))
    assert _grow(resumed, plain, messages, kwargs, ends) == len(ends) - 1
    return resumed, plain, messages


def test_qwen3_agent_loop_resumes_every_turn_and_matches():
    messages, tools = agent_trace(AgentTraceSpec(rounds=12))
    prepared, prepared_tools = prepare_messages(messages), prepare_tools(tools)
    resumed, plain = _pair(QWEN3)
    ends = round_ends(prepared)
    hits = _grow(resumed, plain, prepared, {"tools": prepared_tools, "add_generation_prompt": True}, ends)
    assert hits == len(ends) - 1  # every turn after the first


def test_qwen3_new_user_turn_rewrites_earlier_reasoning_and_still_matches():
    """A user message moves Qwen3's last query: earlier assistant turns lose their reasoning. The last query moved
    from message 0 to 2, so every iteration from message 0 - 1 on may render otherwise: nothing is reused."""
    conv = [{"role": "user", "content": "a"},
            {"role": "assistant", "content": "b", "reasoning_content": "thinking"},
            {"role": "user", "content": "c"}]
    resumed, plain = _pair(QWEN3)
    prepared = prepare_messages(conv)
    _grow(resumed, plain, prepared, {"add_generation_prompt": True}, [2, 3])
    assert "thinking" in plain.render(PlainMessages(prepared[:2]), add_generation_prompt=False)
    assert "thinking" not in resumed.render(_shared(prepared), add_generation_prompt=True)


THRESHOLD_TEMPLATES = {"qwen3": QWEN3, **{name: (ROOT / "tests" / "fixtures" / "templates" / f"{name}.jinja").read_text(
    encoding="utf-8") for name in ("glm-4.6", "glm-4.7-flash", "minimax-m2")}}


@pytest.mark.parametrize("name", sorted(THRESHOLD_TEMPLATES))
def test_a_chat_growing_by_user_turns_resumes_before_the_last_user_turn_and_matches(name):
    """Each user turn moves the template's last user index (compared only with ``loop.index0``): the loop resumes
    just before the old one, so the previous assistant turn, which loses its reasoning, is rendered again."""
    source = THRESHOLD_TEMPLATES[name]
    plan = plan_message_loop(_ENVIRONMENT.parse(source))
    assert plan is not None and len(plan.thresholds) == 1
    rng = random.Random(7)
    conversation: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    for turn in range(12):
        conversation.append({"role": "user", "content": f"question {turn}: " + " ".join(
            rng.choice(["cats", "rivers", "bits", "tea"]) for _ in range(rng.randint(1, 9)))})
        conversation.append({"role": "assistant", "content": f"answer {turn}",
                             "reasoning_content": f"thinking about {turn}"})
    prepared = prepare_messages(conversation)
    resumed, plain = _pair(source)
    ends = [end for end in range(2, len(prepared) + 1) if prepared[end - 1]["role"] == "user"]
    kwargs = {"add_generation_prompt": True}
    assert _grow(resumed, plain, prepared, kwargs, ends) == len(ends) - 2  # each turn from the third
    assert "thinking about 10" not in plain.render(_shared(prepared), **kwargs)  # (the moved threshold mattered)
    assert "thinking about 11" in plain.render(_shared(prepared), **kwargs)


@pytest.mark.parametrize("reads", [
    "{{ ns.last }}",  # read other than in the comparison
    "{% set ns.last = loop.index0 %}",  # set by the loop
    "{{ show(ns) }}",  # the namespace passed on
    "{{ 'x' if loop.index0 - 1 > ns.last }}",  # compared with something else than the index
    "{{ 'x' if ns.last + 1 > loop.index0 }}",
])
def test_a_value_the_loop_does_more_with_than_compare_with_its_index_is_no_threshold(reads):
    source = ("{%- macro show(v) %}{{ v }}{% endmacro -%}{%- set ns = namespace(last=-1) -%}"
              "{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}{% endif %}{% endfor -%}"
              "{%- for message in messages %}[{{ message.content }}{{ '*' if loop.index0 > ns.last }}" + reads
              + "]{%- endfor %}")
    plan = plan_message_loop(_ENVIRONMENT.parse(source))
    assert plan is not None and plan.thresholds == ()
    assert plan_message_loop(_ENVIRONMENT.parse(source.replace(reads, ""))).thresholds == (("ns", "last"),)


def test_a_macro_that_reads_the_namespace_rules_the_threshold_out():
    source = ("{%- macro mark(i) %}{{ '*' if i > ns.last }}{% endmacro -%}{%- set ns = namespace(last=2) -%}"
              "{%- for message in messages %}[{{ message.content }}{{ '+' if loop.index0 > ns.last }}"
              "{{ mark(loop.index0) }}]{%- endfor %}")
    plan = plan_message_loop(_ENVIRONMENT.parse(source))
    assert plan is not None and plan.thresholds == ()


def test_a_threshold_compared_the_other_way_or_as_a_plain_name_resumes_and_matches():
    """``last >= loop.index`` and a plain name set by the head: the same limit holds (checked against full renders
    on a conversation whose last user turn moves every other message)."""
    source = ("{%- set last = namespace(at=-1) -%}"
              "{%- for m in messages %}{% if m.role == 'user' %}{% set last.at = loop.index0 %}{% endif %}{% endfor -%}"
              "{%- set at = last.at -%}"
              "{%- for message in messages %}<{{ message.content }}{{ '|old' if at >= loop.index }}"
              "{{ '|new' if loop.index0 == at }}>{%- endfor %}")
    plan = plan_message_loop(_ENVIRONMENT.parse(source))
    assert plan is not None and plan.thresholds == (("at", ""),)
    messages = prepare_messages([{"role": "user" if i % 2 == 0 else "assistant", "content": str(i)}
                                 for i in range(16)])
    resumed, plain = _pair(source)
    assert _grow(resumed, plain, messages, {}, list(range(1, 17))) > 8


def test_a_changed_message_in_the_middle_resumes_before_it():
    """The extend's probe replaces one message: the loop resumes before it and renders the rest."""
    messages, tools = agent_trace(AgentTraceSpec(rounds=6))
    prepared, prepared_tools = prepare_messages(messages), prepare_tools(tools)
    resumed, plain = _pair(QWEN3)
    kwargs = {"tools": prepared_tools, "add_generation_prompt": True}
    resumed.render(_shared(prepared), **kwargs)
    k = max(i for i, m in enumerate(prepared) if m["role"] == "assistant")
    probed = PlainMessages([*prepared[:k], {"role": "assistant", "content": "probe"}, *prepared[k + 1:]])
    before = resumed.loop_records.resumed
    assert resumed.render(probed, **kwargs) == plain.render(probed, **kwargs)
    assert resumed.loop_records.resumed == before + 1


def test_a_resumed_render_sizes_its_text_and_record_from_the_record_it_kept():
    """A resumed render counts only its own blocks: the text's size, where each iteration starts in characters and
    where the first non-ASCII block is come from the record for the blocks it keeps. Each is checked against the
    joined text, on an ASCII conversation whose one non-ASCII message (a tool result) arrives in a resumed render
    and is then kept while ASCII ones follow."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."},
                                      {"role": "user", "content": "Find the large files."}]
    for i in range(8):
        call = {"id": f"call_{i}", "type": "function", "function": {"name": "ls", "arguments": '{"dir": "."}'}}
        result = "Größe: 東京.bin" if i == 3 else f"{i} files"
        messages += [{"role": "assistant", "content": f"Looking, step {i}.", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"call_{i}", "content": result}]
    prepared = prepare_messages(messages)
    resumed, plain = _pair(QWEN3)
    records = resumed.loop_records
    assert records is not None
    kwargs = {"add_generation_prompt": True}
    for end in range(3, len(prepared) + 1):
        head = _shared(prepared[:end])
        output = resumed.render_output(head, **kwargs)
        assert output is not None and output.starts is not None
        text = output.text()
        assert text == plain.render(head, **kwargs) and output.chars == len(text), end
        record, shared = records.find(head)
        assert record is not None and shared == end
        blocks = record.blocks
        assert record.start_chars == [len("".join(blocks[:b])) for b in record.starts], end
        assert record.first_wide == next((i for i, b in enumerate(blocks) if not b.isascii()), len(blocks)), end
        assert record.text_bytes == len(text) * (1 if text.isascii() else 4), end
    assert records.resumed == len(prepared) - 3  # every render after the first


def test_other_tools_or_flags_are_not_resumed_from_a_record_made_with_others():
    messages, tools = agent_trace(AgentTraceSpec(rounds=4))
    prepared = prepare_messages(messages)
    resumed, plain = _pair(QWEN3)
    resumed.render(_shared(prepared[:-1]), tools=prepare_tools(tools), add_generation_prompt=True)
    for kwargs in ({"tools": prepare_tools(tools[:1]), "add_generation_prompt": True},
                   {"tools": prepare_tools(tools), "add_generation_prompt": False, "enable_thinking": False}):
        assert resumed.render(prepared, **kwargs) == plain.render(prepared, **kwargs)


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.name)
def test_shipped_templates_resume_byte_identically(path):
    source = path.read_text(encoding="utf-8")
    resumed, plain = _pair(source)
    if resumed.loop_records is None:
        pytest.skip("no resumable message loop proved for this template (renders are full ones)")
    total = 0
    for conv in CONVERSATIONS:
        if conv.kwargs.get("continue_final_message"):
            continue
        messages, kwargs = template_inputs(conv)
        total += _grow(resumed, plain, messages, kwargs, list(range(1, len(messages) + 1)))
    assert total > 0


# --------------------------------------------------------------------------- what the plan refuses, and why

LOOP_WITH = "{%- for message in messages %}[{{ message.content }}{{ X }}]{%- endfor %}"


@pytest.mark.parametrize("reads", ["{{ loop.length }}", "{{ loop.revindex }}", "{{ messages|length }}",
                                   "{{ messages[-1].content }}", "{{ strftime_now('%Y') }}",
                                   "{{ loop.changed(message.role) }}", "{% for m in messages %}{% endfor %}"])
def test_iterations_that_read_the_whole_conversation_are_not_resumable(reads):
    source = LOOP_WITH.replace("{{ X }}", reads)
    assert plan_message_loop(_ENVIRONMENT.parse(source)) is None
    assert ChatTemplate(source).loop_records is None


def test_reach_counts_how_far_ahead_an_iteration_reads():
    source = LOOP_WITH.replace("{{ X }}", "{{ messages[loop.index0 + 2].role if not loop.last }}")
    plan = plan_message_loop(_ENVIRONMENT.parse(source))
    assert plan is not None and plan.reach == 2


NAMESPACE_TEMPLATE = (
    "{%- set ns = namespace(calls=0, last_role='') -%}"
    "{%- for message in messages -%}"
    "{%- if message.tool_calls -%}{%- set ns.calls = ns.calls + message.tool_calls|length -%}{%- endif -%}"
    "<{{ message.role }}#{{ ns.calls }} after {{ ns.last_role }}"
    "{{ ' (last)' if loop.last }}{{ ' then ' ~ loop.nextitem.role if loop.nextitem }}>"
    "{%- set ns.last_role = message.role -%}"
    "{%- endfor -%}{{ '<gen>' if add_generation_prompt }}"
)


def test_namespace_state_is_restored_where_the_loop_resumes():
    _grow_trace_a_message_at_a_time(NAMESPACE_TEMPLATE, 5, {"add_generation_prompt": True})


def test_a_read_at_a_negative_index_leaves_no_record_to_resume():
    """``messages[loop.index0 - 1]`` at the first message is Python's messages[-1], the conversation's last
    message: which one that is changes as it grows, so that render files no record."""
    source = "{%- for message in messages -%}[{{ messages[loop.index0 - 1].content }}]{%- endfor -%}"
    resumed, plain = _pair(source)
    assert resumed.loop_records is None  # the proof saw no render it could resume
    # guarded as real templates guard it, the same read is resumable
    guarded = source.replace("{{ messages", "{{ '' if loop.first else messages")
    resumed, plain = _pair(guarded)
    assert resumed.loop_records is not None
    messages = prepare_messages([{"role": "user", "content": str(i)} for i in range(6)])
    # (a render of two messages resumes at none: the last one before the new may look ahead)
    assert _grow(resumed, plain, messages, {}, list(range(1, 7))) == 4


def test_records_are_bounded_and_dropped_when_the_conversation_moves_on():
    resumed = ChatTemplate(QWEN3, loop_record_bytes=32 << 20)
    assert resumed.loop_records is not None
    messages, tools = agent_trace(AgentTraceSpec(rounds=8))
    prepared, prepared_tools = prepare_messages(messages), prepare_tools(tools)
    for end in round_ends(prepared):
        resumed.render(_shared(prepared[:end]), tools=prepared_tools, add_generation_prompt=True)
    stats = resumed.loop_records.stats()
    assert stats.entries == 1  # each turn's record replaced the one before
    assert 0 < stats.bytes <= 32 << 20
    # the index files each message of the last record once (a turn files only what it added), and nothing stale
    assert len(resumed.loop_records._index) == round_ends(prepared)[-1]
    resumed.loop_records.clear()
    assert not resumed.loop_records._index and not resumed.loop_records._lineages
    # a record past an eighth of the bound is not kept: the render is a full one, and right
    small = ChatTemplate(QWEN3, loop_record_bytes=64 << 10)
    assert small.loop_records is not None
    whole = _shared(prepared)
    assert small.render(whole, tools=prepared_tools, add_generation_prompt=True) == \
        resumed.render(whole, tools=prepared_tools, add_generation_prompt=True)
    assert small.loop_records.stats().entries == 0
    # messages decoded afresh (no message memo) are never sent again as these objects: no record is filed
    fresh = ChatTemplate(QWEN3)
    assert fresh.loop_records is not None
    fresh.render(PlainMessages(prepared), tools=prepared_tools, add_generation_prompt=True)
    assert fresh.loop_records.stats().entries == 0


def test_a_render_of_a_shorter_head_files_nothing_and_the_conversation_still_resumes():
    """Earlier turns of a recorded conversation rendered again (a retry, a rewound rollout) resume from the
    conversation's record, equal the plain render, and leave that record the only one, its index untouched."""
    resumed, plain = _pair(QWEN3)
    assert resumed.loop_records is not None
    messages, tools = agent_trace(AgentTraceSpec(rounds=8))
    prepared, prepared_tools = prepare_messages(messages), prepare_tools(tools)
    kwargs = {"tools": prepared_tools, "add_generation_prompt": True}
    ends = round_ends(prepared)
    resumed.render(_shared(prepared[:ends[-2]]), **kwargs)
    index = dict(resumed.loop_records._index)
    count = resumed.loop_records.resumed
    for end in (ends[-2] - 1, ends[-2] - 3):
        head = _shared(prepared[:end])
        assert resumed.render(head, **kwargs) == plain.render(head, **kwargs)
    assert resumed.loop_records.resumed == count + 2
    assert resumed.loop_records.stats().entries == 1 and resumed.loop_records._index == index
    whole = _shared(prepared[:ends[-1]])
    assert resumed.render(whole, **kwargs) == plain.render(whole, **kwargs)
    assert resumed.loop_records.resumed == count + 3 and resumed.loop_records.stats().entries == 1


def test_the_render_path_resumes_a_growing_agent_conversation_through_the_message_memo():
    """Bodies decoded as the render server decodes them: the memo hands out the same message objects each turn,
    so each turn resumes; the ids equal those of a configuration without any render cache."""
    import msgspec

    from bench.agent_trace import chat_body
    from render_service.render.render import render_chat
    from render_service.render.render_config import load_render_config
    from render_service.wire.message_memo import decode_chat_request
    from render_service.wire.protocol import ChatCompletionRequest

    def decode(body: bytes, kind: type) -> ChatCompletionRequest:
        return msgspec.json.decode(body, type=kind)

    cached = load_render_config(str(QWEN3_DIR), served_model_names=["m"])
    bare = load_render_config(str(QWEN3_DIR), served_model_names=["m"], render_cache_bytes=0)
    assert cached.template is not None and cached.template.loop_records is not None
    assert bare.template is not None and bare.template.loop_records is None  # 0 turns every cache off
    assert "template_loops" in cached.caches.stats()
    messages, tools = agent_trace(AgentTraceSpec(rounds=6))
    ends = round_ends(messages)
    assert cached.template.loop_records.resumed == 0  # (the template's proof at load leaves no counts)
    for end in ends:
        body = msgspec.json.encode({**chat_body("m", messages[:end], tools), "tool_choice": "none"})
        ids = [list(render_chat(decode_chat_request(body, config.message_memo, decode),
                                config).token_ids) for config in (cached, bare)]
        assert ids[0] == ids[1], end
    assert cached.template.loop_records.resumed == len(ends) - 1
    assert cached.caches.stats()["template_loops"].hits == len(ends) - 1


# --------------------------------------------------------------------------- loops the plan finds, and where they start

FIXTURES = ROOT / "tests" / "fixtures" / "templates"


def _user_turns(count: int) -> list[dict[str, Any]]:
    return prepare_messages([{"role": "system", "content": "s"},
                             *({"role": "user" if i % 2 == 0 else "assistant", "content": str(i)}
                               for i in range(count))])


def test_a_loop_whose_body_never_reads_loop_resumes():
    """Jinja steps such a loop without a LoopContext; the plan makes it step one so the session sees each
    iteration start."""
    source = "{%- for message in messages -%}<{{ message.role }}>{{ message.content }}{%- endfor -%}"
    resumed, plain = _pair(source)
    messages = _user_turns(8)
    assert _grow(resumed, plain, messages, {}, list(range(1, len(messages) + 1))) == len(messages) - 2


SETS_MESSAGES = ("{%- if messages[0].role == 'system' %}{%- set messages = messages[1:] %}{%- endif %}"
                 "{%- for message in messages %}[{{ message.content }}>"
                 "{{ loop.nextitem.content if loop.nextitem }}{{ messages[1].content }}]{%- endfor %}")


def test_a_template_that_sets_messages_to_a_tail_resumes_before_the_first_changed_message():
    """The loop iterates the template's own ``messages`` (a tail of the render's): a changed message in the middle
    must be rendered again by the iteration before it, which looks ahead at it."""
    resumed, plain = _pair(SETS_MESSAGES)
    messages = _user_turns(8)
    assert _grow(resumed, plain, messages, {}, list(range(1, len(messages) + 1))) > 0
    resumed.render(_shared(messages))
    before = resumed.loop_records.resumed
    probed = PlainMessages([*messages[:5], {"role": "user", "content": "X"}, *messages[6:]])
    assert resumed.render(probed) == plain.render(probed)
    assert resumed.loop_records.resumed == before + 1


def test_a_constant_index_into_a_tail_counts_from_where_the_tail_starts():
    """``loop_messages[2]`` is messages[3]: a record made before that message existed is not resumed."""
    source = ("{%- set loop_messages = messages[1:] -%}{%- for message in loop_messages -%}"
              "[{{ loop.index }}{{ message.content }}|{{ loop_messages[2] is defined }}]{%- endfor -%}")
    resumed, plain = _pair(source)
    messages = _user_turns(8)
    assert _grow(resumed, plain, messages, {}, list(range(1, len(messages) + 1))) > 0


SUFFIX_LOOP = (
    "{%- set ns = namespace(split=-1) -%}"
    "{%- for i in range(messages|length) -%}{%- if messages[i].role == 'assistant' and not messages[i].tool_calls -%}"
    "{%- set ns.split = i -%}{%- endif -%}{%- endfor -%}"
    "{%- for message in messages[:ns.split + 1] -%}({{ message.content }}){%- endfor -%}"
    "{%- set suffix = messages[ns.split + 1:] -%}"
    "{%- for message in suffix -%}[{{ message.role }}:{{ message.content }}"
    "{{ '+' ~ suffix[loop.index0 + 1].role if not loop.last }}]{%- endfor -%}"
)


def test_a_loop_over_a_tail_the_head_computes_resumes_while_the_tail_starts_at_the_same_message():
    resumed, plain, prepared = _grow_trace_a_message_at_a_time(SUFFIX_LOOP, 6, {})
    # a plain answer moves where the tail starts: nothing is resumed, and the render is right
    answered = [*prepared, *prepare_messages([{"role": "assistant", "content": "done"},
                                              {"role": "user", "content": "more"}])]
    before = resumed.loop_records.resumed
    _grow(resumed, plain, answered, {}, [len(answered) - 1])
    assert resumed.loop_records.resumed == before


BRANCH_LOOPS = (
    "{%- if tools -%}{%- for message in messages -%}<T {{ message.content }}{{ '.' if loop.last }}>{%- endfor -%}"
    "{%- else -%}{%- for message in messages -%}<P {{ message.content }}>{%- endfor -%}{%- endif -%}"
)


def test_each_branch_loop_resumes_only_from_its_own_record():
    resumed, plain = _pair(BRANCH_LOOPS)
    messages = _user_turns(6)
    tools = prepare_tools([{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert _grow(resumed, plain, messages, {"tools": tools}, [4, 5]) == 1
    before = resumed.loop_records.resumed
    _grow(resumed, plain, messages, {}, [6])  # the other loop: the record made with tools is not its
    assert resumed.loop_records.resumed == before
    assert _grow(resumed, plain, messages, {}, [7]) == 1


def test_a_scan_of_the_messages_that_writes_nothing_is_part_of_the_head():
    source = ("{%- set ns = namespace(system=false) -%}{%- for m in messages -%}"
              "{%- if m.role == 'system' -%}{%- set ns.system = true -%}{%- endif -%}{%- endfor -%}"
              "{{ 'default system' if not ns.system }}"
              "{%- for message in messages -%}<{{ message.content }}>{%- endfor -%}")
    plan = plan_message_loop(_ENVIRONMENT.parse(source))
    assert plan is not None and plan.loop.target.name == "message"
    resumed, plain = _pair(source)
    messages = _user_turns(6)[1:]
    assert _grow(resumed, plain, messages, {}, list(range(1, len(messages) + 1))) > 0


@pytest.mark.parametrize("source", [
    # an index into another tail than the loop's (rest[i + 1] is messages[i + 2])
    "{%- set rest = messages[1:] -%}{%- for message in messages -%}"
    "{{ rest[loop.index0 + 1].content if not loop.last }}{%- endfor -%}",
    # the loop's list set anew in the loop
    "{%- set loop_messages = messages -%}{%- for message in loop_messages -%}{%- set loop_messages = messages[2:] -%}"
    "{{ loop_messages[loop.index0].content }}{%- endfor -%}",
    # messages set to something other than a tail of them
    "{%- set messages = messages|reverse|list -%}{%- for message in messages -%}{{ message.content }}{%- endfor -%}",
    "{%- set messages = messages[:1] + [{'content': 'x'}] + messages[2:] -%}"
    "{%- for message in messages -%}{{ message.content }}{%- endfor -%}",
    # an index into the render's messages while the loop iterates a tail the template set `messages` to
    "{%- set loop_messages = messages[1:] -%}{%- set messages = messages[1:] -%}"
    "{%- for message in loop_messages -%}{{ messages[loop.index0 + 1].content }}{%- endfor -%}",
])
def test_loops_whose_reads_of_the_messages_cannot_be_placed_are_not_resumable(source):
    assert plan_message_loop(_ENVIRONMENT.parse(source)) is None


@pytest.mark.parametrize(("name", "unresumed"), [("llama-4", 2), ("internlm2-tool", 2), ("seed-oss", 2),
                                                 ("hunyuan-a13b", 1), ("kimi-k2-thinking", 1)])
def test_templates_whose_loop_now_resumes_resume_an_agent_loop(name, unresumed):
    """(llama-4 sets ``messages`` to a tail, kimi loops over a tail the head computes, hunyuan has a loop per
    branch, the others read no ``loop`` attribute.) Not resumed: the first request, and where the loop leaves the
    system message out, the second (the first one's loop had only the task, which looks at the next message)."""
    resumed, plain = _pair((FIXTURES / f"{name}.jinja").read_text(encoding="utf-8"))
    assert resumed.loop_records is not None
    messages, _ = agent_trace(AgentTraceSpec(rounds=6))
    prepared = prepare_messages(messages)
    ends = round_ends(prepared)
    assert _grow(resumed, plain, prepared, {"add_generation_prompt": True}, ends) == len(ends) - unresumed


@pytest.mark.parametrize("writes", ["{% set ns.last = m.content %}", "{{ mark(m.content) }}"])
def test_a_namespace_the_loop_only_writes_is_restored_where_the_loop_resumes(writes):
    """``{% set ns.last = ... %}`` (in the loop or a macro it calls) reads no ``ns`` by name, yet the tail reads
    what the iterations left there."""
    source = ("{%- macro mark(x) %}{% set ns.last = x %}{% endmacro -%}"
              "{%- set ns = namespace(last='') -%}{%- for m in messages -%}[{{ m.content }}]"
              "{%- if m.role == 'user' %}" + writes + "{% endif -%}{%- endfor -%}({{ ns.last }})")
    resumed, plain = _pair(source)
    messages = prepare_messages([{"role": "user" if i in (0, 2) else "assistant", "content": str(i)}
                                 for i in range(8)])
    assert _grow(resumed, plain, messages, {}, list(range(1, 9))) == 6


def _random_message(rng: random.Random, i: int) -> dict[str, Any]:
    role = rng.choice(["user", "assistant", "user", "assistant", "calls", "tool", "system"])
    if role == "calls":
        return {"role": "assistant", "content": rng.choice(["", f"a{i}"]), "tool_calls": [
            {"id": f"c{i}_{j}", "type": "function", "function": {"name": "f", "arguments": {"a": str(j)}}}
            for j in range(rng.randint(1, 2))]}
    if role == "tool":
        return {"role": "tool", "tool_call_id": f"c{i - 1}_0", "content": f"r{i}"}
    message = {"role": role, "content": f"m{i}"}
    if role == "assistant" and rng.random() < 0.3:
        message["reasoning_content"] = f"t{i}"
    return message


def _render_or_error(template: ChatTemplate, messages: PlainMessages, kwargs: dict[str, Any]) -> str | None:
    try:
        return template.render(messages, **kwargs)
    except Exception:
        return None  # the template's own refusal: both must refuse


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.name)
def test_random_conversations_and_changed_messages_render_as_full_renders(path):
    """Conversations of any shape (not only those a template accepts), grown one message at a time, and then one
    message in the middle replaced (the extend's probe)."""
    source = path.read_text(encoding="utf-8")
    resumed, plain = _pair(source)
    if resumed.loop_records is None:
        pytest.skip("no resumable message loop proved for this template (renders are full ones)")
    rng = random.Random(path.name)
    tools = prepare_tools([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    before = resumed.loop_records.resumed
    for _ in range(12):
        messages = prepare_messages([_random_message(rng, i) for i in range(rng.randint(2, 10))])
        kwargs = rng.choice([{}, {"add_generation_prompt": True}, {"tools": tools, "add_generation_prompt": True},
                             {"enable_thinking": False, "add_generation_prompt": True}])
        for end in range(1, len(messages) + 1):
            head = _shared(messages[:end])
            assert _render_or_error(resumed, head, kwargs) == _render_or_error(plain, head, kwargs), end
        k = rng.randrange(1, len(messages) - 1) if len(messages) > 2 else 1
        probe = prepare_messages([{"role": messages[k]["role"], "content": "probe"}])
        probed = PlainMessages([*messages[:k], *probe, *messages[k + 1:]])
        assert _render_or_error(resumed, probed, kwargs) == _render_or_error(plain, probed, kwargs), k
    assert resumed.loop_records.resumed > before


def test_two_conversations_with_the_same_first_messages_each_resume_every_turn():
    """Agents that share their system prompt and first messages (the memo hands out the same objects) grow side by
    side: each turn resumes from its own conversation's record, however the other has filed the shared head."""
    resumed, plain = _pair(QWEN3)
    assert resumed.loop_records is not None
    messages, tools = agent_trace(AgentTraceSpec(rounds=6))
    prepared, prepared_tools = prepare_messages(messages), prepare_tools(tools)
    ends = round_ends(prepared)
    fork = ends[1]
    other = prepared[:fork] + [dict(m, content=f"other {i}") if m.get("content") else dict(m)
                               for i, m in enumerate(prepared[fork:])]
    before = resumed.loop_records.resumed
    kwargs = {"tools": prepared_tools, "add_generation_prompt": True}
    for end in ends[2:]:
        for conversation in (prepared, other):
            head = _shared(conversation[:end])
            assert resumed.render(head, **kwargs) == plain.render(head, **kwargs), end
    assert resumed.loop_records.resumed - before == 2 * len(ends[2:]) - 1  # all but the very first render
