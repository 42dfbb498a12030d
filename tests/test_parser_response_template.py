"""hf and beam: reasoning and tool calls read by the bundle's ``response_template``. The template is the one Gemma 4's
checkpoints publish (``tests/family_bundles.py``), over a test tokenizer with Gemma 4's control tokens at their ids;
the vectors are vLLM's response-template tests, where our rules differ as docs/tool_parsers.md says."""

from __future__ import annotations

import copy
import json

import pytest

from render_service.bundle.model_bundle import load_bundle
from render_service.parsers.auto import resolve_auto
from render_service.parsers.base import ReasoningParserConfig, TextPiece, ToolParserConfig, ToolSpec
from render_service.parsers.pipeline import Pipeline, PipelineConfig, derender_all
from render_service.parsers.registry import get_reasoning_parser, get_tool_parser
from render_service.parsers.response_template import bind_parser, load_response_template
from render_service.render.render_config import build_render_config
from tests.family_bundles import GEMMA4_RESPONSE_TEMPLATE, GEMMA4_TEMPLATE_METADATA, write_family_bundle
from tests.test_pipeline import stream_fold
from tests.test_tool_parsers_common import fold, split_reasoning

pytestmark = pytest.mark.slow  # builds a test tokenizer (cached after the first run)

Q = '<|"|>'
THINKING = "<|channel>thought\nplan<channel|>"
TOOL = f"<|tool_call>call:set_alarm{{hour:7,label:{Q}morning{Q}}}<tool_call|>"
TOOLS = [
    ToolSpec(name="set_alarm", parameters={"type": "object", "properties": {
        "hour": {"oneOf": [{"type": "integer"}, {"type": "null"}]}, "label": {"type": "string"}}}),
    ToolSpec(name="get_weather", parameters={"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string"}}}),
    ToolSpec(name="complex_function", parameters={"type": "object", "properties": {
        "nested": {"type": "object", "properties": {"inner": {"type": "string"}}},
        "list": {"type": "array", "items": {"type": "string"}}}}),
    ToolSpec(name="configure", parameters={"type": "object", "properties": {
        "enabled": {"type": "boolean"}, "ratio": {"type": "number"}, "label": {"type": "string"},
        "value": {"type": ["string", "null"]}}}),
]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return load_bundle(write_family_bundle("hf", tmp_path_factory.mktemp("hf") / "bundle"))


def _tools(name: str, text: str, chunks: list[str] | None = None, template=GEMMA4_TEMPLATE_METADATA):
    parser = bind_parser(get_tool_parser(name), template)(ToolParserConfig(tools=TOOLS))

    def run(parts: list[str]):
        state = parser.initial_state()
        return fold([p for part in parts for p in parser.feed(state, part)] + parser.finish(state))

    whole = run([text])
    assert run(list(text)) == whole  # one character at a time == batch
    if chunks is not None:
        assert run(chunks) == whole
    return whole


@pytest.mark.parametrize("name", ["hf", "beam"])
@pytest.mark.parametrize("text, calls, content", [
    ("Hello<turn|>", [], "Hello"),
    # without the reasoning stage the thinking block is content, its delimiters markup (upstream's routing)
    (THINKING + "The answer is 42.<turn|>", [], "planThe answer is 42."),
    ("Let me check." + TOOL, [("set_alarm", {"hour": 7, "label": "morning"})], "Let me check."),
    (f"<|tool_call>call:get_weather{{city:{Q}Paris{Q},unit:{Q}celsius{Q}}}<tool_call|>" + TOOL,
     [("get_weather", {"city": "Paris", "unit": "celsius"}), ("set_alarm", {"hour": 7, "label": "morning"})], None),
    (f"<|tool_call>call:complex_function{{nested:{{inner:{Q}value{Q}}},list:[{Q}a{Q},{Q}b{Q}]}}<tool_call|>",
     [("complex_function", {"nested": {"inner": "value"}, "list": ["a", "b"]})], None),
    # values the JSON already typed stay as they are
    ("<|tool_call>call:configure{enabled:false,ratio:5.0,label:null,value:null}<tool_call|>",
     [("configure", {"enabled": False, "ratio": 5.0, "label": None, "value": None})], None),
    (TOOL + "Done.<turn|>", [("set_alarm", {"hour": 7, "label": "morning"})], "Done."),
    # a call to a tool the request did not declare is the model's call all the same (upstream forwards it)
    (TOOL.replace("set_alarm", "unknown"), [("unknown", {"hour": 7, "label": "morning"})], None),
])
def test_calls(name, text, calls, content) -> None:
    folded = _tools(name, text, [text[i:i + 7] for i in range(0, len(text), 7)])
    assert [(c["name"], json.loads(c["arguments"])) for c in folded.calls] == calls
    assert folded.content == content


@pytest.mark.parametrize("text", [
    TOOL.replace("<tool_call|>", "unexpected<tool_call|>"),  # not JSON: upstream drops the region
    f"<|tool_call>call:get-weather{{city:{Q}London{Q}}}<tool_call|>",  # a name the opener does not take
    f"<|tool_call>call:get_weather{{city:{Q}London",  # cut before its closer: upstream reads what it got
])
def test_a_region_that_is_no_call_is_the_models_text(text) -> None:
    folded = _tools("hf", text)
    assert folded.calls == [] and folded.content == text


def test_a_call_after_a_malformed_one_is_read() -> None:
    text = TOOL.replace("<tool_call|>", "unexpected<tool_call|>") + TOOL
    folded = _tools("hf", text)
    assert [(c["name"], json.loads(c["arguments"])) for c in folded.calls] == [
        ("set_alarm", {"hour": 7, "label": "morning"})]


def test_a_name_from_the_regions_json_through_the_transform() -> None:
    template = {"defaults": {"role": "assistant"}, "start_anchor": "<|turn>model\n", "fields": {"tool_calls": {
        "open": "<tool>", "close": "</tool>", "content": "json",
        "transform": {"type": "function", "function": {"name": "{content.name}", "arguments": "{content.arguments}"}}}}}
    folded = _tools("hf", '<tool>{"name":"set_alarm","arguments":{"hour":"7"}}</tool>',
                    template=type(GEMMA4_TEMPLATE_METADATA)(response_template=template))
    # the schema types the string argument
    assert [(c["name"], json.loads(c["arguments"])) for c in folded.calls] == [("set_alarm", {"hour": 7})]


def _split(text: str, open_at_start: bool) -> list[tuple[str, str]]:
    cls = bind_parser(get_reasoning_parser("hf"), GEMMA4_TEMPLATE_METADATA)
    parser = cls(ReasoningParserConfig(reasoning_open_at_start=open_at_start))

    return split_reasoning(parser, text)


@pytest.mark.parametrize("text, open_at_start, expected", [
    (THINKING + "The answer is 42.", False, [("reasoning", "plan"), ("content", "The answer is 42.")]),
    ("Direct answer without reasoning.", False, [("content", "Direct answer without reasoning.")]),
    # the prompt left the block open
    ("continued reasoning<channel|>Final answer", True,
     [("reasoning", "continued reasoning"), ("content", "Final answer")]),
])
def test_reasoning(text, open_at_start, expected) -> None:
    assert _split(text, open_at_start) == expected


def test_gemma4s_control_tokens_are_single_ids(bundle) -> None:
    tok = bundle.tokenizer
    for text, i in (("<|tool_call>", 48), ("<tool_call|>", 49), (Q, 52), ("<|channel>", 100), ("<turn|>", 106)):
        assert tok.encode(text) == [i]
    assert tok.response_template == GEMMA4_RESPONSE_TEMPLATE  # read from tokenizer_config.json


@pytest.mark.parametrize("name", ["hf", "beam"])
@pytest.mark.parametrize("prompt, text, reasoning, content", [
    ("<|turn>model\n", THINKING + "Checking." + TOOL, "plan", "Checking."),
    ("<|turn>model\n", "Checking." + TOOL, None, "Checking."),
    # the prompt opened the thinking block after its last start anchor
    ("<|turn>model\n<|channel>thought\n", "continued reasoning<channel|>Checking." + TOOL, "continued reasoning",
     "Checking."),
])
def test_one_token_streaming_equals_batch(bundle, name, prompt, text, reasoning, content) -> None:
    tok = bundle.tokenizer
    ids, prompt_ids = tok.encode(text), tok.encode("<|turn>user\nWake me<turn|>\n" + prompt)
    assert 48 in ids
    pipeline = Pipeline(tok, PipelineConfig(request_id="r", reasoning_parser=name, tool_parser=name,
                                            tool_choice="auto", tools=TOOLS, skip_special_tokens=False))
    batch, _ = derender_all(pipeline, ids, prompt_ids)
    assert stream_fold(pipeline, ids, list(range(1, len(ids))), prompt_ids) == batch
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in batch["tool_calls"]] == [
        ("set_alarm", {"hour": 7, "label": "morning"})]
    assert batch["reasoning"] == reasoning and batch["content"] == content


@pytest.mark.parametrize("flags", [{"reasoning_parser": "hf"}, {"tool_call_parser": "beam"}])
def test_a_bundle_without_the_metadata_is_refused_at_startup(flags) -> None:
    from tests.render_harness import qwen3_bundle

    with pytest.raises(ValueError, match="requires response_template metadata"):
        build_render_config(qwen3_bundle(), served_model_names=["m"], **flags)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t["fields"].pop("tool_calls"), "tool_calls field"),
    (lambda t: t["fields"]["thinking"].update(content="json"), "only plain text"),
    (lambda t: t["fields"].update(citations={}), "cannot be served"),
    (lambda t: t.pop("start_anchor"), "start_anchor"),
])
def test_a_template_that_cannot_be_served_is_refused(edit, message) -> None:
    template = copy.deepcopy(GEMMA4_RESPONSE_TEMPLATE)
    edit(template)
    with pytest.raises(ValueError, match=message):
        bind_parser(get_tool_parser("hf"), type(GEMMA4_TEMPLATE_METADATA)(response_template=template))
    if message == "tool_calls field":
        load_response_template(template)  # the template itself is fine: only the tool parser needs the field


def test_auto_reads_a_bundle_that_describes_its_reply() -> None:
    # no family's markers, but the bundle carries response_template metadata: hf for the fields it has
    assert resolve_auto("auto", "auto", "{{ messages }}", None, GEMMA4_RESPONSE_TEMPLATE) == ("hf", "hf")
    no_thinking = copy.deepcopy(GEMMA4_RESPONSE_TEMPLATE)
    no_thinking["fields"].pop("thinking")
    assert resolve_auto("auto", "auto", "{{ messages }}", None, no_thinking) == (None, "hf")


def test_a_region_past_the_bound_is_text_and_the_state_stays_small() -> None:
    import msgspec

    from render_service.parsers.response_template import MAX_REGION_CHARS

    parser = bind_parser(get_tool_parser("hf"), GEMMA4_TEMPLATE_METADATA)(ToolParserConfig(tools=TOOLS))
    state = parser.initial_state()
    opening = "<|tool_call>call:set_alarm{label:" + Q
    out = list(parser.feed(state, opening))
    for _ in range(MAX_REGION_CHARS // 1000 + 1):
        out += parser.feed(state, "x" * 1000)
    out += parser.feed(state, Q + "}<tool_call|>after") + parser.finish(state)
    folded = fold(out)
    assert folded.calls == [] and folded.content.startswith(opening) and folded.content.endswith("after")
    assert len(msgspec.msgpack.encode(state)) < 100


def test_a_region_nested_past_the_stack_is_text() -> None:
    text = "<|tool_call>call:set_alarm{label:" + "[" * 50_000 + "}<tool_call|>"
    folded = _tools("hf", text)
    assert folded.calls == [] and folded.content == text


def test_an_opener_that_keeps_growing_is_text_and_the_state_stays_small() -> None:
    import msgspec

    parser = bind_parser(get_tool_parser("hf"), GEMMA4_TEMPLATE_METADATA)(ToolParserConfig(tools=TOOLS))
    state = parser.initial_state()
    out = list(parser.feed(state, "<|tool_call>call:"))
    for _ in range(10):
        out += parser.feed(state, "a" * 1000)  # a name the pattern keeps matching
        assert len(msgspec.msgpack.encode(state)) < 5000
    out += parser.finish(state)
    assert fold(out) == fold([TextPiece("content", "<|tool_call>call:" + "a" * 10_000)])


def test_the_template_is_part_of_the_fingerprint_where_a_parser_reads_it(bundle) -> None:
    read = build_render_config(bundle, served_model_names=["m"], tool_call_parser="hf")
    other = copy.copy(bundle)
    other.tokenizer = copy.copy(bundle.tokenizer)
    other.tokenizer.response_template = copy.deepcopy(GEMMA4_RESPONSE_TEMPLATE)
    other.tokenizer.response_template["fields"]["tool_calls"]["close"] = "<end_call|>"
    # tiers whose templates differ would read calls differently: their fingerprints differ
    assert build_render_config(other, served_model_names=["m"], tool_call_parser="hf").fingerprint != read.fingerprint
    # a family that does not read the template ignores it
    assert build_render_config(bundle, served_model_names=["m"], tool_call_parser="gemma4").fingerprint == \
        build_render_config(other, served_model_names=["m"], tool_call_parser="gemma4").fingerprint
