"""The render's fast paths (template_inline's inline reads and loops, prepared messages taken without a second copy)
give the text Jinja's own immutable sandbox gives, and take nothing from the sandbox's refusals or the budget."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from bench.agent_trace import AgentTraceSpec, agent_trace
from render_service.bundle.builtin_templates import BUILTIN_TEMPLATES, builtin_template_source
from render_service.bundle.default_bundle import default_template_source
from render_service.templates.chat_messages import prepare_messages, prepare_tools
from render_service.templates.chat_template import (
    ChatTemplate,
    PlainMessages,
    TemplateError,
    plain_copy,
    template_message,
)
from render_service.templates.sandbox import (
    _ENVIRONMENT,
    _REQUEST_ENVIRONMENT,
    GenerationBlocks,
    _raise_exception,
    _SafeNamespace,
    _strftime_now,
)
from tests.conversations import CONVERSATIONS, template_inputs
from tests.shared_paths import QWEN3_FIXTURE_DIR

FAMILY_TEMPLATES = Path(__file__).resolve().parent / "fixtures" / "templates"


def _templates() -> dict[str, str]:
    """Every template we ship or test: Qwen3's (the shared fixture), our default, DeepSeek's, the families'."""
    config = json.loads((QWEN3_FIXTURE_DIR / "tokenizer_config.json").read_text())
    sources = {"qwen3": config["chat_template"], "default": default_template_source()}
    for model_type, name in sorted(BUILTIN_TEMPLATES.items(), key=lambda item: item[1]):
        sources[Path(name).stem] = builtin_template_source(model_type) or ""
    for path in sorted(FAMILY_TEMPLATES.glob("*.jinja")):
        sources[path.stem] = path.read_text()
    return sources


TEMPLATES = _templates()
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}


def _vanilla_environment() -> ImmutableSandboxedEnvironment:
    """Jinja's own immutable sandbox as transformers builds it: no inline reads, no shortcuts, no budget."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlocks, jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=dict,
                       namespace=_SafeNamespace)
    return env


VANILLA = _vanilla_environment()


def _vanilla_render(template: jinja2.Template, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
    """What the template renders in plain Jinja, from messages copied as ChatTemplate always copied them."""
    context = plain_copy({**SPECIAL, **kwargs})
    context.update(messages=[template_message(m) for m in messages], tools=plain_copy(kwargs.get("tools")),
                   documents=plain_copy(kwargs.get("documents")))
    try:
        return template.render(context)
    except Exception as exc:  # noqa: BLE001 (any failure: ours must refuse too)
        return f"refused: {type(exc).__name__}"


def _our_render(template: ChatTemplate, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
    try:
        return template.render(messages, **kwargs)
    except TemplateError as exc:
        cause = exc.__cause__
        return f"refused: {type(cause).__name__ if cause is not None else 'TemplateError'}"


def _agent_inputs() -> tuple[list[dict[str, Any]], dict[str, Any]]:
    messages, tools = agent_trace(AgentTraceSpec(rounds=6, result_chars=(200, 900), seed=3))
    return prepare_messages(messages), {"tools": prepare_tools(tools), "add_generation_prompt": True}


CASES = [(c.name, *template_inputs(c)) for c in CONVERSATIONS if not c.kwargs.get("continue_final_message")]
CASES.append(("agent_trace", *_agent_inputs()))


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_every_template_renders_every_conversation_as_plain_jinja(name):
    source = TEMPLATES[name]
    assert "_fast_obj" in _ENVIRONMENT.compile(source, raw=True)  # the inline reads are what is tested here
    template = ChatTemplate(source, SPECIAL)
    vanilla = VANILLA.from_string(source)
    rendered = 0
    for case, messages, kwargs in CASES:
        assert type(messages) is PlainMessages
        expected = _vanilla_render(vanilla, messages, kwargs)
        # prepared messages (taken without a second copy), and the same messages as a plain list (copied); a
        # template that prints the clock (strftime_now) is rendered again where a second ticked in between
        for given in (messages, list(messages)):
            ours = _our_render(template, given, kwargs)
            if ours != expected:
                expected = _vanilla_render(vanilla, messages, kwargs)
            assert ours == expected, case
        rendered += not expected.startswith("refused")
    assert rendered >= len(CASES) // 2  # most conversations render (refusals are compared too)


def test_the_agent_trace_renders_as_plain_jinja_in_a_request_template_too():
    source = TEMPLATES["qwen3"]
    _, messages, kwargs = CASES[-1]
    expected = _vanilla_render(VANILLA.from_string(source), messages, kwargs)
    assert len(expected) > 10_000 and "<tool_response>" in expected
    assert ChatTemplate(source, SPECIAL, from_request=True).render(messages, **kwargs) == expected


LOOP_PROBES = [
    "{% for x in xs %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}"
    "{{ loop.last }}{{ loop.length }}{{ loop.depth }}{{ loop.depth0 }}|{% endfor %}",
    "{% for x in xs %}{{ loop.previtem }}>{{ x }}>{{ loop.nextitem }}{{ loop.last }}{{ loop.cycle('a', 'b') }}"
    "{{ loop.changed(x) }};{% endfor %}",
    "{% for x in xs if x != 2 %}{{ loop.index0 }}{{ loop.last }}{{ loop.length }}{% endfor %}",
    "{% for x in xs|reverse %}{{ loop.last }}{{ loop.nextitem }}{% endfor %}",
    "{% for x in t %}{{ loop.last }}{{ loop.revindex }}{% endfor %}{% for c in s %}{{ loop.last }}{% endfor %}",
    "{% for k, v in d.items() %}{{ loop.last }}{{ k }}{{ v }}{% endfor %}{% for k in d %}{{ loop.first }}{% endfor %}",
    "{% for x in xs %}{% for y in xs %}{{ loop.depth }}{{ loop.last }}{% endfor %}{{ loop.index }}{% endfor %}",
    "{% for x in xs %}{% if loop.last %}{{ loop.nextitem is defined }}{% endif %}{{ loop.nextitem }}"
    "{{ loop.last }}{% endfor %}",
    "{% for x in xs %}{% for y in loop %}{{ y }}{% endfor %}|{% endfor %}",
    "{% for x in xs %}{% if x == 2 %}{% break %}{% endif %}{{ loop.last }}{% endfor %}",
    "{% for n in tree recursive %}{{ n.name }}{{ loop.depth }}{{ loop.last }}"
    "{% if n.children %}[{{ loop(n.children) }}]{% endif %}{% endfor %}",
    "{% for x in [] %}{{ loop.last }}{% else %}empty{% endfor %}{% for x in xs %}{% endfor %}{{ loop }}",
]
LOOP_DATA = {"xs": [1, 2, 3, 2], "t": (4, 5), "s": "ab", "d": {"k": 1, "j": 2},
             "tree": [{"name": "a", "children": [{"name": "b", "children": []}, {"name": "c"}]}, {"name": "d"}]}


@pytest.mark.parametrize("source", LOOP_PROBES)
def test_loops_answer_as_jinjas_loop_context(source):
    expected = VANILLA.from_string(source).render(LOOP_DATA)
    for from_request in (False, True):
        template = ChatTemplate(source, from_request=from_request)
        assert template.render([{"role": "user", "content": "x"}], **LOOP_DATA) == expected


# What a template could try through the inline paths: underscore and dict attributes on data, the loop's and the
# namespace's internals, str.format however it is reached, mutation. Every answer (a refusal's message included)
# must be what Jinja's own immutable sandbox gives, in the model's sandbox and a request's.
SECURITY_PROBES = [
    "{{ m.__class__ }}{{ m.role }}{{ m.__class__.__mro__ }}",
    "{{ m.items }}{{ m.get('role') }}{{ m.keys()|list }}{{ m.startswith }}{{ m._private }}",
    "{{ m.pop('role') }}",
    "{{ m.update({'role': 'x'}) }}",
    "{{ m.clear }}",
    "{{ ms.append }}",
    "{% for x in ms %}{{ loop.__class__ }}{{ loop._iterable }}{{ loop._items }}{{ loop._step }}{% endfor %}",
    "{% for x in ms %}{{ loop.__class__.__mro__ }}{{ loop.__init__.__globals__ }}{% endfor %}",
    "{% set ns = namespace(a=1) %}{{ ns._Namespace__attrs }}{{ ns.__class__.__mro__ }}{{ ns.a }}{{ ns.b }}",
    "{% set ns = namespace(f='{0.__class__.__mro__}'.format) %}{{ ns.f(m) }}",
    "{% set ns = namespace(f='{0.__class__}'['format']) %}{{ ns.f(m) }}",
    "{% set ns = namespace(f=m.content.format) %}{{ ns.f(ms) }}",
    "{{ m.content.format(ms) }}{{ m.content.format_map({'0': ms}) }}",
    "{{ m.content.strip.__self__ }}{{ m.content.__class__.__base__.__subclasses__() }}",
    "{{ m.content.strip('{') }}{{ m.content.split('.') }}{{ m.content.startswith('{') }}{{ m.content.upper() }}",
    "{{ m.content.center(10) }}{{ m.content.replace('0', 'zero') }}{{ m.content.strip(1) }}",
    "{{ ('x'|safe).strip() }}{{ m.content.strip.__call__('{') }}",
    "{{ m.startswith('k') }}",
    "{{ ms.split(',') }}",
    "{{ m.content.strip('{', 1, 2) }}",
    "{% for x in ms %}{{ loop.index0.__class__ }}{{ loop.first.__class__.__mro__ }}{% endfor %}",
]
PROBE_DATA = {"m": {"role": "user", "content": "{0.__class__}.x", "__class__": "data", "startswith": "key",
                    "_private": "underscore key"},
              "ms": [{"role": "user", "content": "a"}]}


def _answer(render: Any) -> str:
    """The text rendered, or the refusal as ChatTemplate words it (a 400's message)."""
    try:
        return re.sub(r" at 0x[0-9a-f]+", "", render())  # a method's address
    except TemplateError as exc:
        return f"refused: {exc}"
    except jinja2.TemplateError as exc:
        return f"refused: {exc.message}"
    except (TypeError, ValueError, LookupError, AttributeError) as exc:
        return f"refused: Chat template failed: {type(exc).__name__}: {exc}"


@pytest.mark.parametrize("source", SECURITY_PROBES)
def test_inline_paths_keep_every_refusal_of_jinjas_sandbox(source):
    expected = _answer(lambda: VANILLA.from_string(source).render(PROBE_DATA))
    for from_request in (False, True):
        for _ in range(2):  # cold and warm (the sandbox remembers attributes found safe)
            template = ChatTemplate(source, from_request=from_request)
            got = _answer(lambda: template.render([{"role": "user", "content": "x"}], **PROBE_DATA))  # noqa: B023
            assert got == expected, (from_request, source)


def test_request_templates_keep_the_sandboxs_call_path_for_str_methods():
    source = "{{ messages[0].content.strip() }}{{ messages[0].content.center(10**9) }}"
    assert "_fast_obj.strip(" in _ENVIRONMENT.compile(source, raw=True)
    assert "_fast_obj.strip(" not in _REQUEST_ENVIRONMENT.compile(source, raw=True)
    with pytest.raises(TemplateError, match="too large"):  # the size check a request's calls go through
        ChatTemplate(source, from_request=True).render([{"role": "user", "content": " x "}])


@pytest.mark.parametrize("from_request", [False, True])
def test_the_cpu_deadline_still_ends_loops_of_inline_reads(from_request):
    source = ("{% for a in range(99999) %}{% for b in range(99999) %}{% for m in messages %}"
              "{{ m.role if loop.first and m.content.strip() else '' }}{% endfor %}{% endfor %}{% endfor %}")
    template = ChatTemplate(source, time_limit_s=0.05, from_request=from_request)
    with pytest.raises(TemplateError, match="time limit"):
        template.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}])


@pytest.mark.parametrize("spans", [False, True])
def test_the_output_bound_fires_on_both_render_paths(spans):
    template = ChatTemplate("{% for i in range(100000) %}{{ messages[0].content * 1000 }}{% endfor %}")
    messages = [{"role": "user", "content": "y"}]
    with pytest.raises(TemplateError, match="exceeds"):
        if spans:
            template.render_with_spans(messages)
        else:
            template.render(messages)


def test_continue_final_message_leaves_prepared_messages_as_they_were():
    messages = prepare_messages([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}])
    before = json.dumps(messages)
    template = ChatTemplate(TEMPLATES["qwen3"])
    first = template.render(messages, continue_final_message=True)
    assert first.endswith("Hel") and template.render(messages, continue_final_message=True) == first
    assert json.dumps(messages) == before

    parts = prepare_messages([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}],
                             content_format="openai")
    before = json.dumps(parts)
    source = ("{% for m in messages %}{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endfor %}")
    own = ChatTemplate(source)
    assert own.render(parts, continue_final_message=True) == own.render(parts, continue_final_message=True) \
        == "[hi][Hel"
    assert json.dumps(parts) == before


def test_continue_final_message_tags_every_alias_of_listed_reasoning():
    source = "{{ messages[-1].thinking[0].text }}|{{ messages[-1].reasoning_content[0].text }}"
    parts = [{"type": "text", "text": "thought"}]
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "reasoning_content": parts}]
    # Both names hold one list: the tag reaches both (as when the part was tagged in place), and the cut is
    # at the last one.
    text = ChatTemplate(source).render(messages, continue_final_message="reasoning_content")
    assert text == "thoughtCONTINUE_FINAL_MESSAGE_TAG |thought"
    assert parts == [{"type": "text", "text": "thought"}]


def _containers(value: Any) -> list[int]:
    found = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, (dict, list, tuple)):
            found.append(id(item))
            stack.extend(item.values() if isinstance(item, dict) else item)
    return found


class _Text(str):
    pass


def test_prepared_messages_and_tools_are_plain_copies_sharing_nothing_with_the_request():
    """What the render takes without copying again: fresh containers, plain types only."""
    import datetime

    request = [
        {"role": _Text("assistant"), "content": "", "reasoning": _Text("r"),
         "tool_calls": [{"id": datetime.date(2026, 1, 1), "type": "function",
                         "function": {"name": _Text("f"), "arguments": {"x": [1, (2, 3)], "when": {1, 2}}}},
                        {"id": "b", "type": "function", "function": {"name": "g", "arguments": '{"y": [4]}'}}]},
        {"role": "developer", "content": [{"type": "text", "text": _Text("d")}], "tools": [{"k": ["v"]}]},
        {"role": "tool", "tool_call_id": _Text("b"), "content": "ok", "name": _Text("n")},
    ]
    tools = [{"type": "function", "function": {"name": _Text("f"), "description": _Text("d"),
                                               "parameters": {"type": "object", "properties": {"x": {"enum": [1]}}}}}]
    prepared = prepare_messages(request, content_format="openai")
    prepared_tools = prepare_tools(tools)
    assert not set(_containers(prepared) + _containers(prepared_tools)) & set(_containers(request) + _containers(tools))
    # types as plain_copy leaves them (a non-JSON value is an inert name)
    call = prepared[0]["tool_calls"][0]
    assert call == {"id": "<date>", "type": "function",
                    "function": {"name": "f", "arguments": {"x": [1, (2, 3)], "when": "<set>"}}}
    assert prepared[0]["tool_calls"][1]["function"]["arguments"] == {"y": [4]}
    for text in (prepared[0]["role"], prepared[0]["reasoning"], call["function"]["name"],
                 prepared[1]["content"][0]["text"], prepared[2]["tool_call_id"], prepared[2]["name"],
                 prepared_tools[0]["function"]["name"], prepared_tools[0]["function"]["description"]):
        assert type(text) is str
