"""Chat templates: token IDs identical to transformers' apply_chat_template, over Qwen3's real template and ours."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jinja2
import pytest

from render_service.bundle.default_bundle import default_template_source
from render_service.bundle.model_bundle import load_bundle
from render_service.templates.analysis import detect_content_format
from render_service.templates.chat_messages import convert_developer_role, prepare_messages, prepare_tools
from render_service.templates.chat_template import ChatTemplate, TemplateError, assistant_token_mask
from render_service.templates.sandbox import compile_template
from tests.conversations import CONVERSATIONS, Conversation, by_name, template_inputs
from tests.shared_paths import QWEN3_FIXTURE_DIR

transformers = pytest.importorskip("transformers")

FIXTURE_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "qwen3-0.6b"
if not FIXTURE_DIR.exists():
    FIXTURE_DIR = QWEN3_FIXTURE_DIR
VLLM_RENDER_DIR = FIXTURE_DIR.parent / "vllm-0.32-render"


class Side:
    """One bundle directory as both our render path and transformers see it."""

    def __init__(self, path: Path) -> None:
        self.bundle = load_bundle(path)
        self.template = ChatTemplate(self.bundle.chat_template,
                                     self.bundle.template_special_tokens)
        self.hf = transformers.AutoTokenizer.from_pretrained(str(path))

    def our_ids(self, messages, **kwargs) -> list[int]:
        return self.bundle.tokenizer.encode(self.template.render(messages, **kwargs))

    def hf_ids(self, messages, **kwargs) -> list[int]:
        out = self.hf.apply_chat_template(messages, tokenize=True, **kwargs)
        # transformers 5 returns a BatchEncoding by default; 4.x a list.
        return list(out["input_ids"]) if hasattr(out, "keys") else list(out)


@pytest.fixture(scope="module")
def own_bundle_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("own-template-bundle")
    shutil.copy(FIXTURE_DIR / "tokenizer.json", root / "tokenizer.json")
    config = json.loads((FIXTURE_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = default_template_source()
    (root / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def sides(own_bundle_dir) -> dict[str, Side]:
    return {"qwen3": Side(FIXTURE_DIR), "own": Side(own_bundle_dir)}


def _inputs(conv: Conversation) -> tuple[list[dict], dict]:
    return template_inputs(conv)


def test_there_are_at_least_thirty_conversations():
    assert len(CONVERSATIONS) >= 30
    assert len({c.name for c in CONVERSATIONS}) == len(CONVERSATIONS)


@pytest.mark.parametrize("template_name", ["qwen3", "own"])
@pytest.mark.parametrize("conv", CONVERSATIONS, ids=lambda c: c.name)
def test_token_ids_equal_transformers(sides, template_name, conv):
    side = sides[template_name]
    messages, kwargs = _inputs(conv)
    ours = side.our_ids(messages, **kwargs)
    assert ours == side.hf_ids(messages, **kwargs)
    assert len(ours) > 0


@pytest.mark.parametrize("template_name", ["qwen3", "own"])
def test_text_parts_render_like_joined_string(sides, template_name):
    template = sides[template_name].template
    parts = prepare_messages([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    joined = prepare_messages([{"role": "user", "content": "a\nb"}])
    assert template.render(parts, add_generation_prompt=True) == template.render(joined, add_generation_prompt=True)


def test_render_does_not_modify_the_callers_messages(sides):
    conv = by_name("continue_final_message")
    messages, kwargs = _inputs(conv)
    before = json.dumps(messages)
    sides["qwen3"].template.render(messages, **kwargs)
    assert json.dumps(messages) == before


# Messages handed to the template as they are (no prepare_messages): HF's own normalisation applies.
RAW_MESSAGE_CASES = {
    "none_valued_keys_dropped": [
        {"role": "user", "content": "hi", "name": None, "tool_calls": None},
        {"role": "assistant", "content": "hello", "reasoning_content": None, "tool_calls": None},
    ],
    "reasoning_under_old_name_thinking": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "thinking": "pondering"},
    ],
    "reasoning_under_new_name_reasoning": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "weighing"},
    ],
}

MESSAGE_KEYS_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}:{% for k in m %}{{ k }},{% endfor %}|{{ m.content }}"
    "{% if m.reasoning_content is defined %}<r>{{ m.reasoning_content }}</r>{% endif %}\n{% endfor %}"
)


@pytest.mark.parametrize("template_name", ["qwen3", "own", "keys"])
@pytest.mark.parametrize("case", sorted(RAW_MESSAGE_CASES))
def test_raw_messages_equal_transformers(sides, template_name, case):
    side = sides["own" if template_name == "own" else "qwen3"]
    messages = RAW_MESSAGE_CASES[case]
    if template_name == "keys":
        ours = side.bundle.tokenizer.encode(ChatTemplate(MESSAGE_KEYS_TEMPLATE).render(messages))
        ref = side.hf.apply_chat_template(messages, chat_template=MESSAGE_KEYS_TEMPLATE, tokenize=True)
        assert ours == list(ref["input_ids"] if hasattr(ref, "keys") else ref)
    else:
        assert side.our_ids(messages, add_generation_prompt=False) == side.hf_ids(messages, add_generation_prompt=False)


# ----------------------------------------------------------------------------- our own template's behaviour

def test_own_template_generation_prompt_follows_enable_thinking(sides):
    template = sides["own"].template
    messages = prepare_messages([{"role": "user", "content": "hi"}])
    assert template.render(messages, add_generation_prompt=True).endswith("<|im_start|>assistant\n")
    assert template.render(messages, add_generation_prompt=True, enable_thinking=True).endswith(
        "<|im_start|>assistant\n")
    assert template.render(messages, add_generation_prompt=True, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_own_template_writes_tool_calls_the_hermes_parser_reads(sides):
    messages, kwargs = _inputs(by_name("several_tool_calls_then_results_in_a_row"))
    text = sides["own"].template.render(messages, **kwargs)
    bodies = [chunk.split("\n</tool_call>")[0] for chunk in text.split("<tool_call>\n")[2:]]
    calls = [json.loads(body) for body in bodies]
    assert calls == [{"name": "get_weather", "arguments": {"city": "Seoul"}},
                     {"name": "search_web", "arguments": {"query": "Seoul air quality"}}]
    assert "<|im_start|>user\n<tool_response>\nSunny, 21°C\n</tool_response>\n<tool_response>\nAQI 42 (good)" \
           "\n</tool_response><|im_end|>\n" in text


def test_own_template_keeps_reasoning_in_every_turn(sides):
    messages, kwargs = _inputs(by_name("reasoning_field_newer_name"))
    text = sides["own"].template.render(messages, **kwargs)
    assert "<|im_start|>assistant\n<think>\nThe capital of France is Paris.\n</think>\n\nParis.<|im_end|>" in text
    assert "<|im_start|>assistant\n<think>\nItaly's capital is Rome.\n</think>\n\nRome.<|im_end|>" in text


def test_own_template_next_prompt_extends_previous_prompt_and_output(sides):
    # Prefix caching across turns: prompt(turn 2) starts with prompt(turn 1) + the model's output.
    template = sides["own"].template
    turn1 = prepare_messages([{"role": "user", "content": "2+2?"}])
    prompt1 = template.render(turn1, add_generation_prompt=True)
    output = "<think>\nAdd them.\n</think>\n\n4<|im_end|>"
    turn2 = prepare_messages([{"role": "user", "content": "2+2?"},
                              {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
                              {"role": "user", "content": "3+3?"}])
    assert template.render(turn2, add_generation_prompt=True).startswith(prompt1 + output)


def test_own_template_rejects_unknown_roles(sides):
    with pytest.raises(TemplateError, match="Unsupported message role: narrator"):
        sides["own"].template.render([{"role": "narrator", "content": "Once upon a time"}])


def test_own_template_assistant_mask_equals_transformers(sides):
    side = sides["own"]
    messages, kwargs = _inputs(by_name("agent_loop_answer_then_follow_up"))
    kwargs["add_generation_prompt"] = False
    rendered = side.template.render_with_spans(messages, **kwargs)
    encoding = side.bundle.tokenizer.hf.encode(rendered.text, add_special_tokens=False)
    ours = assistant_token_mask(encoding.offsets, rendered.generation_spans)
    ref = side.hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True, **kwargs)
    assert encoding.ids == list(ref["input_ids"])
    assert ours == list(ref["assistant_masks"])
    assert 0 < sum(ours) < len(ours)
    masked = side.bundle.tokenizer.decode([i for i, m in zip(encoding.ids, ours) if m], skip_special_tokens=False)
    assert masked.startswith("<think>\nCall the tool.\n</think>\n\n<tool_call>")
    assert masked.endswith("It is sunny and 21°C.<|im_end|>")


def test_qwen_template_has_no_generation_spans(sides):
    rendered = sides["qwen3"].template.render_with_spans(prepare_messages(by_name("multi_turn").messages))
    assert rendered.generation_spans == []


# ----------------------------------------------------------------------------- HF's rules and errors

@pytest.mark.parametrize("template_name", ["qwen3", "own"])
def test_continue_final_message_with_generation_prompt_is_an_error(sides, template_name):
    messages, _ = _inputs(by_name("continue_final_message"))
    with pytest.raises(TemplateError, match="not compatible"):
        sides[template_name].template.render(messages, continue_final_message=True, add_generation_prompt=True)


def test_continue_final_message_cuts_after_the_final_content(sides):
    messages, kwargs = _inputs(by_name("continue_final_message"))
    assert sides["qwen3"].template.render(messages, **kwargs).endswith("Soft rain on the roof,")
    assert sides["own"].template.render(messages, **kwargs).endswith("Soft rain on the roof,")


def test_continue_final_message_without_content_is_an_error(sides):
    with pytest.raises(TemplateError, match='has no "content" to continue'):
        sides["own"].template.render([{"role": "user", "content": "hi"}, {"role": "assistant"}],
                                     continue_final_message=True)


def test_continue_final_message_field_the_template_never_reads_is_an_error():
    template = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(TemplateError, match="not an accepted field"):
        template.render([{"role": "assistant", "content": "x", "reasoning_content": "r"}],
                        continue_final_message="reasoning_content")


def test_continue_final_message_that_the_template_drops_is_an_error():
    template = ChatTemplate("{% for m in messages[:-1] %}{{ m.content }}{% endfor %}")
    with pytest.raises(TemplateError, match="does not appear in the chat"):
        template.render([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                        continue_final_message=True)


def test_empty_conversation_is_an_error(sides):
    with pytest.raises(TemplateError, match="empty conversation"):
        sides["qwen3"].template.render([], add_generation_prompt=True)


@pytest.mark.parametrize("template_name", ["qwen3", "own"])
def test_template_errors_are_client_errors(sides, template_name):
    # Qwen's template calls .startswith on content: a mapping there is a template runtime error.
    with pytest.raises(TemplateError):
        sides[template_name].template.render([{"role": "user", "content": {"not": "text"}},
                                              {"role": "bogus"}], add_generation_prompt=True)


RAISING_TEMPLATE = (
    "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
    "{{ raise_exception('Only user and assistant roles are supported, got ' + m.role) }}{% endif %}"
    "{{ m.content }}{% endfor %}"
)


def test_raise_exception_becomes_template_error_with_its_message(sides):
    template = ChatTemplate(RAISING_TEMPLATE)
    with pytest.raises(TemplateError) as excinfo:
        template.render([{"role": "system", "content": "x"}])
    assert str(excinfo.value) == "Only user and assistant roles are supported, got system"
    assert isinstance(excinfo.value, ValueError)
    with pytest.raises(Exception, match="Only user and assistant roles are supported, got system"):
        sides["qwen3"].hf.apply_chat_template([{"role": "system", "content": "x"}], chat_template=RAISING_TEMPLATE,
                                              tokenize=False)


def test_template_syntax_error_is_template_error():
    with pytest.raises(TemplateError, match="Invalid chat template"):
        ChatTemplate("{% for m in messages %}{{ m.content }")


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__ }}",
    "{% set ns = namespace() %}{% set ns._secret = 1 %}x",
    "{% set xs = [] %}{{ xs.append(1) }}",
])
def test_sandbox_refusals_are_template_errors(source):
    with pytest.raises(TemplateError):
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])


SANDBOX_PROBES = [
    "{% for m in messages %}{{ loop.index0 }}{{ m.content.strip().startswith('h') }}{{ 'x,y'.split(',')|length }}"
    "{% endfor %}",
    "{{ 'a{}b'.format(messages|length) }}{{ '{a[role]}'.format_map({'a': messages[0]}) }}",
    "{{ '{0.__class__}'.format(messages[0]) }}",
    "{{ '{0.__class__.__mro__}'.format(messages) }}",
    "{{ messages.__class__.__mro__ }}",
    "{{ messages[0].content.__class__.__base__ }}",
    "{{ messages[0].content.strip.__call__() }}",
    "{{ (messages[0].content.strip).__self__ }}{{ '{0}'.format.__self__ }}",
    "{% for m in messages %}{{ loop.__class__.__init__ }}{% endfor %}",
    "{% set xs = [] %}{{ xs.append(1) }}",
    # macros and dict reads are called without the sandbox's generic path: same answers, same refusals
    "{% macro f(x, y=1) %}[{{ x }}{{ y }}{{ varargs|length }}{{ kwargs|length }}]{% endmacro %}"
    "{{ f(1) }}{{ f(2, y=3) }}{{ f(1, 2, 3, z=4) }}",
    "{% macro w(tag) %}<{{ tag }}:{{ caller(tag) }}>{% endmacro %}{% call(t) w('b') %}in {{ t }}{% endcall %}",
    "{% macro r(n) %}{% if n %}{{ n }}{{ r(n - 1) }}{% endif %}{% endmacro %}{{ r(3) }}",
    "{% macro f(x) %}({{ x }}){% endmacro %}{% for m in messages %}{% set y = m.role %}{{ f(y) }}{% endfor %}",
    "{% for m in messages %}{{ m.get('role') }}{{ m.get('name', 'none') }}{% for k, v in m.items() %}{{ k }}"
    "{% endfor %}{{ m.keys()|list|length }}{{ m.values()|list|length }}{% endfor %}",
    "{% set ns = namespace(a=1) %}{% for i in range(3) %}{% set ns.a = ns.a + i %}{% endfor %}{{ ns.a }}"
    "{{ range(2, 9, 3)|list }}",
    "{{ messages[0].pop('role') }}",
    "{{ messages[0].update({'a': 1}) }}",
    "{{ messages[0].setdefault('a', 1) }}",
]


@pytest.mark.parametrize("source", SANDBOX_PROBES)
def test_sandbox_shortcuts_answer_as_jinjas_sandbox_however_often_asked(source):
    """The sandbox remembers attributes found safe and calls str methods directly; what a template may reach
    (str.format's wrapping included) must stay what Jinja's own immutable sandbox allows, warm or cold."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    vanilla = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    messages = [{"role": "user", "content": " hi "}, {"role": "assistant", "content": "ok"}]
    try:
        expected = vanilla.from_string(source).render(messages=messages)
    except jinja2.exceptions.SecurityError as exc:
        expected = f"refused: {exc}"
    for _ in range(3):
        try:
            got = ChatTemplate(source).render(messages)
        except TemplateError as exc:
            got = f"refused: {exc}"
        assert got == expected


@pytest.mark.parametrize("source, message", [
    ("{{ 'x' * 10**10 }}", "too large"),
    ("{{ [0] * 10**10 }}", "too large"),
    ("{{ 7 ** 100000000 }}", "too large"),
    ("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}", "exceeds"),
])
def test_runaway_templates_are_template_errors_not_memory_exhaustion(source, message):
    with pytest.raises(TemplateError, match=message):
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])


def test_bounded_arithmetic_still_works():
    assert ChatTemplate("{{ '-' * 3 }}{{ 2 ** 10 }}{{ [1] * 2 }}").render([{"role": "user"}]) == "---1024[1, 1]"


def test_templates_compile_once_per_source():
    source = "{{ messages[0].content }} compiled-once-check"
    first = ChatTemplate(source)
    misses = compile_template.cache_info().misses
    second = ChatTemplate(source)
    assert compile_template.cache_info().misses == misses
    assert first._template is second._template


# ----------------------------------------------------------------------------- --chat-template overrides and kwargs

CUSTOM_TEMPLATE = """{{- bos_token if bos_token is defined else '' -}}
{%- set ns = namespace(turns=0) -%}
{%- for m in messages -%}
  {%- if m.role == 'system' %}{% continue %}{% endif -%}
  {%- set ns.turns = ns.turns + 1 -%}
  [{{ ns.turns }}:{{ m.role | upper }}] {{ m.content | trim }}{{ eos_token }}
  {%- if m.tool_calls is defined %}{{ m.tool_calls | tojson(indent=2, sort_keys=true) }}{% endif -%}
  {%- if ns.turns >= 4 %}{% break %}{% endif %}
{% endfor -%}
{%- if tools %}TOOLS={{ tools | map(attribute='function') | map(attribute='name') | join(',') }}
{{ tools[0] | tojson(separators=(',', ':')) }}{% endif -%}
{%- if documents %}{% for d in documents %}<doc {{ dict(title=d.title) | tojson }}>{{ d.text }}</doc>{% endfor %}{% endif -%}
{%- if add_generation_prompt %}[{{ greeting | default('ASSISTANT') }}]{% endif -%}"""


@pytest.mark.parametrize("conv", [by_name("agent_loop_answer_then_follow_up"), by_name("documents"),
                                  by_name("emoji"), by_name("multi_turn")], ids=lambda c: c.name)
def test_custom_template_override_matches_transformers(sides, conv):
    side = sides["qwen3"]
    messages, kwargs = _inputs(conv)
    kwargs["greeting"] = "Ready ✅"
    template = ChatTemplate(CUSTOM_TEMPLATE, side.bundle.template_special_tokens)
    ours = side.bundle.tokenizer.encode(template.render(messages, **kwargs))
    ref = side.hf.apply_chat_template(messages, chat_template=CUSTOM_TEMPLATE, tokenize=True, **kwargs)
    assert ours == list(ref["input_ids"] if hasattr(ref, "keys") else ref)


@pytest.mark.parametrize("conv", [by_name("continue_final_message"), by_name("continue_final_message_trailing_space")],
                         ids=lambda c: c.name)
def test_custom_template_continue_final_message_matches_transformers(sides, conv):
    # CUSTOM_TEMPLATE trims content, so the trailing-space case takes HF's "trimmed" branch.
    side = sides["qwen3"]
    messages, kwargs = _inputs(conv)
    text = ChatTemplate(CUSTOM_TEMPLATE, side.bundle.template_special_tokens).render(
        messages, **kwargs)
    ref = side.hf.apply_chat_template(messages, chat_template=CUSTOM_TEMPLATE, tokenize=False, **kwargs)
    assert text == ref


def test_special_tokens_are_template_variables_and_kwargs_override_them(sides):
    template = ChatTemplate("{{ eos_token }}|{{ pad_token }}|{{ bos_token is defined }}",
                            sides["qwen3"].bundle.template_special_tokens)
    assert template.render([{"role": "user", "content": ""}]) == "<|im_end|>|<|endoftext|>|False"
    assert template.render([{"role": "user", "content": ""}], eos_token="END").startswith("END|")


def _own_template_config(sides, **flags):
    from render_service.render.render_config import build_render_config

    return build_render_config(sides["own"].bundle, served_model_names=["m"], **flags)


def _rendered_text(config, **request) -> str:
    from render_service.render.render import render_chat
    from render_service.wire.protocol import ChatCompletionRequest

    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **request)
    return config.tokenizer.decode(render_chat(req, config).token_ids, skip_special_tokens=False)


def test_default_kwargs_merge_under_request_kwargs(sides):
    # The rule production runs (render_config.resolve_chat_template_kwargs), through render_chat.
    config = _own_template_config(sides, default_chat_template_kwargs={"enable_thinking": False, "unused_flag": 1})
    assert _rendered_text(config).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    request_wins = _rendered_text(config, chat_template_kwargs={"enable_thinking": True})
    assert request_wins.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("key", ["tokenize", "chat_template", "messages", "conversation"])
def test_request_kwargs_that_are_refused(sides, key):
    from render_service.http.errors import ApiError

    with pytest.raises(ApiError, match=f"chat_template_kwargs may not set '{key}'") as raised:
        _rendered_text(_own_template_config(sides), chat_template_kwargs={key: True})
    assert raised.value.status == 400 and raised.value.param == "chat_template_kwargs"


# ----------------------------------------------------------------------------- OpenAI messages -> template messages

def test_prepare_messages_follows_vllm():
    prepared = prepare_messages([
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": None},
                                     {"type": "refusal", "refusal": "b"}, "c"], "name": "u1"},
        {"role": "assistant", "content": None, "reasoning_content": "r",
         "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
                        {"id": "d", "type": "function", "function": {"name": "g", "arguments": ""}},
                        {"id": "e", "type": "function", "function": {"name": "h"}},
                        {"id": "f", "type": "function", "function": {"name": "i", "arguments": "[1, 2]"}},
                        {"id": "g", "type": "function", "function": {"name": "j", "arguments": "{oops"}},
                        {"id": "h", "type": "function", "function": {"name": "k", "arguments": {"y": [2]}}}]},
        {"role": "assistant", "content": "plain", "reasoning": "newer", "reasoning_content": "older",
         "tool_calls": []},
        {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "ok"}], "task": "t"},
    ])
    assert prepared[0] == {"role": "user", "content": "a\nb\nc", "name": "u1"}
    assert prepared[1]["content"] == ""
    assert prepared[1]["reasoning"] == prepared[1]["reasoning_content"] == "r"
    assert [c["function"]["arguments"] for c in prepared[1]["tool_calls"]] == [{"x": 1}, {}, {}, {}, {}, {"y": [2]}]
    # `reasoning` wins over the deprecated `reasoning_content`; an empty tool_calls list is dropped.
    assert prepared[2] == {"role": "assistant", "content": "plain", "reasoning": "newer", "reasoning_content": "newer"}
    assert prepared[3] == {"role": "tool", "content": "ok", "tool_call_id": "c", "task": "t"}


def test_prepare_messages_drops_claude_billing_header_from_system_text():
    prepared = prepare_messages([
        {"role": "system", "content": [{"type": "text", "text": "x-anthropic-billing-header: cch=1\nBe kind."},
                                       {"type": "text", "text": "x-anthropic-billing-header: only"}]},
        {"role": "user", "content": "x-anthropic-billing-header: stays in user text"},
    ])
    assert prepared[0]["content"] == "Be kind."
    assert prepared[1]["content"] == "x-anthropic-billing-header: stays in user text"


def test_prepare_messages_openai_content_format_keeps_parts():
    prepared = prepare_messages([{"role": "user", "content": "hi"}], content_format="openai")
    assert prepared == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}},
])
def test_prepare_messages_refuses_media_parts(part):
    with pytest.raises(TemplateError, match="text-only"):
        prepare_messages([{"role": "user", "content": [{"type": "text", "text": "look"}, part]}])


@pytest.mark.parametrize("messages", [
    "not a list", [42], [{"content": "no role"}], [{"role": "user", "content": 5}],
    [{"role": "assistant", "content": "", "tool_calls": [{"id": "x"}]}],
    [{"role": "assistant", "content": "", "reasoning": ["not", "text"]}],
    [{"role": "assistant", "content": "", "tool_calls": ["not an object"]}],
    [{"role": "assistant", "content": "", "tool_calls": [{"type": "custom", "custom": {"name": "x"}}]}],
])
def test_prepare_messages_rejects_malformed_input(messages):
    with pytest.raises(TemplateError):
        prepare_messages(messages)


def test_prepare_tools_matches_vllm_model_dump_shape():
    assert prepare_tools([{"type": "function", "function": {"name": "now", "strict": True, "x-extra": 1}}]) == [
        {"type": "function", "function": {"name": "now", "description": None, "parameters": None, "strict": True}}
    ]
    assert prepare_tools([{"function": {"name": "later", "description": "d"}, "defer_loading": True}]) == [
        {"type": "function", "defer_loading": True,
         "function": {"name": "later", "description": "d", "parameters": None, "defer_loading": True}}
    ]
    for bad in ([{"type": "retrieval"}], [{"type": "function", "function": {"description": "no name"}}],
                [{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}], "not a list"):
        with pytest.raises(TemplateError):
            prepare_tools(bad)


# Expected values are what vLLM 0.32's own detector (vllm.renderers.hf._detect_content_format) answered.
CONTENT_FORMAT_CASES = {
    "direct_loop_over_content": (
        "{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}", "openai"),
    "alias_slice_and_filter": (
        "{% set msgs = messages[1:] %}{% for m in msgs %}{% if m.content is string %}{{ m.content }}{% else %}"
        "{% for p in m.content | list %}{{ p.text }}{% endfor %}{% endif %}{% endfor %}", "openai"),
    "macro_keyword_receives_content": (
        "{% macro r(x, c=none) %}{% for p in c %}{{ p }}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ r(1, c=m.content) }}{% endfor %}", "openai"),
    "macro_receives_something_else": (
        "{% macro r(c) %}{% for p in c %}{{ p }}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ r(m.role) }}{% endfor %}", "string"),
    "loop_over_a_name_content": (
        "{% for m in messages %}{% set content = m.content %}{% for p in content %}{{ p }}{% endfor %}{% endfor %}",
        "openai"),
    "plain_string_use": ("{% for m in messages %}{{ m.content }}{% endfor %}", "string"),
}


@pytest.mark.parametrize("case", sorted(CONTENT_FORMAT_CASES))
def test_content_format_detection_matches_vllm(case):
    source, expected = CONTENT_FORMAT_CASES[case]
    assert detect_content_format(source) == expected


def test_content_format_of_qwen_and_own_templates(sides):
    assert sides["qwen3"].template.content_format == "string"
    # Ours reads parts with filters, not a loop, so vLLM hands it strings; it still renders parts alike.
    assert sides["own"].template.content_format == "string"
    for name in ("content_parts_everywhere", "tool_call_without_content", "unicode_text"):
        conv = by_name(name)
        _, kwargs = _inputs(conv)
        as_string = sides["own"].template.render(prepare_messages(conv.messages), **kwargs)
        as_parts = sides["own"].template.render(prepare_messages(conv.messages, content_format="openai"), **kwargs)
        assert as_parts == as_string


def test_developer_role_becomes_one_leading_system_message(sides):
    messages = prepare_messages([{"role": "system", "content": "A"}, {"role": "user", "content": "hi"},
                                 {"role": "developer", "content": "B"}])
    converted = convert_developer_role(messages, sides["qwen3"].template)
    assert converted == [{"role": "system", "content": "A\n\nB"}, {"role": "user", "content": "hi"}]
    developer_aware = ChatTemplate("{% if messages[0].role == 'developer' %}dev{% endif %}")
    assert convert_developer_role(messages, developer_aware) is messages


def _recorded_response(request_path: Path) -> dict:
    return json.loads(request_path.with_name(request_path.name.replace(".request.", ".response.")).read_text())


# Only the recorded renders that vLLM answered (its 400s are server rules, tested with the server).
RECORDED_CHAT_RENDERS = [p for p in sorted(VLLM_RENDER_DIR.glob("*/0*_chat_render_*.request.json"))
                         if _recorded_response(p)["status"] == 200]


def test_recorded_vllm_chat_renders_are_present():
    assert len(RECORDED_CHAT_RENDERS) >= 8


@pytest.mark.parametrize("path", RECORDED_CHAT_RENDERS,
                         ids=lambda p: f"{p.parent.name}/{p.name.split('.')[0]}")
def test_recorded_vllm_chat_renders_give_the_same_token_ids(sides, path):
    body = json.loads(path.read_text(encoding="utf-8"))["body"]
    expected = _recorded_response(path)["body"]
    side = sides["qwen3"]
    kwargs = body.get("chat_template_kwargs") or {}
    text = side.template.render(prepare_messages(body["messages"]), tools=prepare_tools(body.get("tools")),
                                add_generation_prompt=body.get("add_generation_prompt", True), **kwargs)
    assert side.bundle.tokenizer.encode(text) == expected["token_ids"]
