"""Muse's channel-scoped messages and ATEM calls (``muse``, ``musespark``, ``muse_glimmer``): vLLM 0.34's cases
for these parsers, and the whole pipeline over Muse Glimmer's own template and a test tokenizer with Muse's
framing tokens at their ids (``tests/family_bundles.py``)."""

from __future__ import annotations

import json

import msgspec
import pytest

from render_service.bundle.model_bundle import load_bundle
from render_service.parsers.auto import detect_family, resolve_auto
from render_service.parsers.base import ReasoningParserConfig, TextPiece, ToolParserConfig, ToolSpec
from render_service.parsers.pipeline import Pipeline, PipelineConfig, derender_all
from render_service.parsers.registry import get_reasoning_parser, get_tool_parser
from render_service.render.render import render_chat_prompt
from render_service.render.render_config import build_render_config
from render_service.render.tool_choice import tool_call_constraint
from render_service.wire.protocol import ChatCompletionRequest
from tests.family_bundles import TEMPLATES, write_family_bundle
from tests.test_pipeline import stream_fold

WEATHER = [ToolSpec(name="get_weather", parameters={"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "note": {"type": "string"}}})]


def _split(text: str, chunks: list[str], tool: str, reasoning: str | None, tools: list[ToolSpec]) -> dict:
    """The reasoning stage (if any) then the tool stage, as the pipeline runs them; pieces folded."""
    tp = get_tool_parser(tool)(ToolParserConfig(tools=tools))
    ts = tp.initial_state()
    rp = get_reasoning_parser(reasoning)(ReasoningParserConfig()) if reasoning else None
    rs = rp.initial_state() if rp else None
    out: dict = {"reasoning": "", "content": "", "calls": {}}

    def take(pieces, through_tools: bool) -> None:
        for p in pieces:
            if isinstance(p, TextPiece) and p.channel == "content" and through_tools:
                take(tp.feed(ts, p.text), False)
            elif isinstance(p, TextPiece):
                out[p.channel] += p.text
            else:
                call = out["calls"].setdefault(p.index, {"name": None, "arguments": ""})
                call["name"] = p.name or call["name"]
                call["arguments"] += p.arguments or ""

    for chunk in chunks:
        if rp is not None:
            take(rp.feed(rs, chunk), True)
        else:
            take(tp.feed(ts, chunk), False)
    if rp is not None:
        take(rp.finish(rs), True)
    take(tp.finish(ts), False)
    out["calls"] = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(out["calls"].items())]
    return out


def split(text: str, tool: str = "muse", reasoning: str | None = None, tools: list[ToolSpec] | None = None) -> dict:
    """Batch, checked equal to one character per feed (stream == batch)."""
    whole = _split(text, [text], tool, reasoning, tools or [])
    assert _split(text, list(text), tool, reasoning, tools or []) == whole
    return whole


def _invoke(name: str, **params: str) -> str:
    return (f'<atem:function_calls>\n<atem:invoke name="{name}">\n'
            + "".join(f'<atem:parameter name="{k}">{v}</atem:parameter>\n' for k, v in params.items())
            + "</atem:invoke>\n</atem:function_calls>")


def _call(name: str) -> str:
    return f"<|start|>assistant to={name}<|message|>" + _invoke(name, city="Paris")


# With and without the reasoning stage in front: the tool stage alone routes reasoning messages too (upstream's).
STAGES = [("muse", None), ("muse", "muse"), ("musespark", "musespark"), ("muse_glimmer", "muse_glimmer"),
          ("muse_glimmer", None)]

# vLLM 0.34's cases (tests/tool_parsers/test_muse*, tests/reasoning/test_muse*): Muse's output, what it means
UPSTREAM_CASES = [
    ("to=self<|message|>Let me check the weather.<|eom|><|start|>assistant to=weather.get<|message|>"
     + _invoke("weather.get", city="Paris", units="celsius") + "<|eot|>",
     "Let me check the weather.", "", [("weather.get", {"city": "Paris", "units": "celsius"})]),
    # parallel calls, one message each; JSON-typed values decode (no schema declares these)
    ("<|start|>assistant to=math.add<|message|>" + _invoke("math.add", a="1", b="2") + "<|eom|>"
     "<|start|>assistant to=math.mul<|message|>" + _invoke("math.mul", a="3", b="4") + "<|eot|>",
     "", "", [("math.add", {"a": 1, "b": 2}), ("math.mul", {"a": 3, "b": 4})]),
    # channel scoping: an invoke quoted in reasoning is not a call
    ('to=self<|message|>I could call <atem:invoke name="evil.fn"><atem:parameter name="x">1</atem:parameter>'
     "</atem:invoke> but I will not.<|eom|><|start|>assistant to=user<|message|>The answer is 42.<|eot|>",
     'I could call <atem:invoke name="evil.fn"><atem:parameter name="x">1</atem:parameter></atem:invoke> but I '
     "will not.", "The answer is 42.", []),
    ("to=user<|message|>Just a plain answer.<|eot|>", "", "Just a plain answer.", []),
    ("<|start|>assistant to=api.call<|message|>"
     + _invoke("api.call", payload='{"nested": [1, 2, 3]}', flag="true") + "<|eot|>",
     "", "", [("api.call", {"payload": {"nested": [1, 2, 3]}, "flag": True})]),
    (" to=self<|message|>thinking<|eom|><|start|>assistant to=user<|message|>The answer is 42.<|eot|>",
     "thinking", "The answer is 42.", []),
    ("Just a direct answer.", "", "Just a direct answer.", []),
    # a reasoning block cut off: the call quoted in it is no call, the reasoning is kept
    (" to=self<|message|>Maybe I should call " + _invoke("read.read", path="/etc/hostname") + " but wait",
     "Maybe I should call " + _invoke("read.read", path="/etc/hostname") + " but wait", "", []),
    (" to=self<|message|>I should read the hostname file to answer.<|eom|><|start|>assistant to=read.read<|message|>"
     + _invoke("read.read", path="/etc/hostname"),
     "I should read the hostname file to answer.", "", [("read.read", {"path": "/etc/hostname"})]),
]


@pytest.mark.parametrize("tool,reasoning", STAGES)
@pytest.mark.parametrize("text,reasoning_text,content,calls", UPSTREAM_CASES)
def test_upstream_cases(tool, reasoning, text, reasoning_text, content, calls) -> None:
    assert split(text, tool, reasoning) == {"reasoning": reasoning_text, "content": content, "calls": calls}


@pytest.mark.parametrize("tool,reasoning", STAGES)
def test_a_header_written_without_ending_reasoning_opens_the_call(tool, reasoning) -> None:
    # upstream's comments: seen from the model for a call with empty arguments; the call must not be lost
    text = " to=self<|message|>No arguments needed.to=get_time<|message|>" + _invoke("get_time")
    assert split(text, tool, reasoning) == {"reasoning": "No arguments needed.", "content": "",
                                            "calls": [("get_time", {})]}


@pytest.mark.parametrize("emitted,registered,name", [
    ("get_weather.get_weather", ["get_weather"], "get_weather"),  # the template advertises bare tools as NAME.*
    ("weather.get", ["weather.get"], "weather.get"),
    ("foo.get_weather", ["get_weather"], "foo.get_weather"),  # a leaf alone could name the wrong tool (0.34)
    ("x.get", ["weather.get", "time.get"], "x.get"),
    ("get_weather.get_weather", [], "get_weather.get_weather"),
    ("get_weather", ["get_weather"], "get_weather"),
])
def test_invoke_names_bind_to_declared_tools_as_upstream(emitted, registered, name) -> None:
    out = split(_call(emitted), tools=[ToolSpec(name=n) for n in registered])
    assert out["calls"] == [(name, {"city": "Paris"})]


def test_muse_types_values_by_the_schema_and_glimmer_keeps_upstreams_older_rule() -> None:
    text = "<|start|>assistant to=get_weather<|message|>" + _invoke(
        "get_weather", city=" New York ", days="3", note='{"a": 1}', extra="[1]") + "<|eom|>"
    # muse: a string keeps every character (JSON-looking or not); undeclared values are JSON when they parse
    assert split(text, "muse", "muse", WEATHER)["calls"] == [
        ("get_weather", {"city": " New York ", "days": 3, "note": '{"a": 1}', "extra": [1]})]
    # muse_glimmer: every value JSON when it parses, the schema aside (upstream's compatibility profile)
    assert split(text, "muse_glimmer", "muse_glimmer", WEATHER)["calls"] == [
        ("get_weather", {"city": " New York ", "days": 3, "note": {"a": 1}, "extra": [1]})]


def test_recipients_route_as_upstream() -> None:
    text = (" to=self<|message|>plan<|eom|><|start|>assistant to=commentary<|message|>Checking. <|eom|>"
            "<|start|>assistant to=developer<|message|>internal<|eom|>"
            "<|start|>assistant<|message|>more thought<|eom|><|start|>assistant to=user<|message|>Done.<|eot|>")
    # muse: commentary is content, developer dropped, a message without recipient is reasoning
    assert split(text, "muse", "muse") == {"reasoning": "planmore thought", "content": "Checking. Done.",
                                          "calls": []}
    # muse_glimmer: no recipient is content; commentary and developer are tools (their text stays content here)
    assert split(text, "muse_glimmer", "muse_glimmer") == {
        "reasoning": "plan", "content": "Checking. internalmore thoughtDone.", "calls": []}


def test_the_reasoning_stage_passes_the_other_messages_on_with_their_markup() -> None:
    parser = get_reasoning_parser("muse")(ReasoningParserConfig())
    state = parser.initial_state()
    pieces = parser.feed(state, " to=self<|message|>plan<|eom|><|start|>assistant to=user<|message|>Hi")
    pieces += parser.finish(state)
    assert [(p.channel, p.text) for p in pieces] == [
        ("reasoning", "plan"), ("content", "<|start|>assistant to=user<|message|>Hi")]


def test_a_held_recipient_is_released_when_no_header_follows() -> None:
    tool = get_tool_parser("muse")(ToolParserConfig())
    state = tool.initial_state()
    assert tool.feed(state, "to=user<|message|>Go to") == [TextPiece("content", "Go ")]  # "to" may be a header
    assert tool.feed(state, " bed") == [TextPiece("content", "to bed")]
    state = msgspec.msgpack.decode(msgspec.msgpack.encode(state), type=type(state))  # stream_state round trip
    assert tool.finish(state) == []


def test_forced_tool_choice_is_left_to_muses_own_markup() -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    for name in ("muse", "musespark", "muse_glimmer"):
        assert tool_call_constraint(name, tools, "required", None, None, None) is None
        assert tool_call_constraint(name, tools, "named", "get_weather", None, None) is None


def test_auto_reads_muse_glimmer_off_its_template() -> None:
    source = (TEMPLATES / "muse-glimmer.jinja").read_text(encoding="utf-8")
    assert detect_family(source, None).name == "muse-glimmer"
    assert resolve_auto("auto", "auto", source, None) == ("muse_glimmer", "muse_glimmer")
    assert resolve_auto("auto", "auto", None, "muse_glimmer") == ("muse_glimmer", "muse_glimmer")


# --- over the test bundle -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def muse(tmp_path_factory):
    return load_bundle(write_family_bundle("muse_glimmer", tmp_path_factory.mktemp("muse") / "bundle"))


@pytest.mark.slow
def test_muse_framing_tokens_are_single_ids(muse) -> None:
    tok = muse.tokenizer
    for text, i in (("<|start|>", 200022), ("<|message|>", 200023), ("<|eom|>", 200007), ("<|eot|>", 200008)):
        assert tok.encode(text) == [i]


@pytest.mark.slow
def test_the_template_writes_calls_the_parser_reads_back(muse) -> None:
    config = build_render_config(muse, served_model_names=["m"], reasoning_parser="muse_glimmer",
                                 tool_call_parser="muse_glimmer")
    args = {"city": "Seoul", "days": 3}
    req = msgspec.convert({"model": "m", "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "reasoning_content": "Look it up.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]},
        ChatCompletionRequest)
    ids, _ = render_chat_prompt(req, config)
    text = muse.tokenizer.decode(ids, skip_special_tokens=False)
    assert text.endswith("<|start|>assistant")
    turn = text[text.index("<|start|>assistant to=self"):text.index("<|start|>tool ")]
    assert split(turn, "muse_glimmer", "muse_glimmer") == {"reasoning": "Look it up.", "content": "",
                                                           "calls": [("get_weather", args)]}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["muse", "muse_glimmer"])
def test_one_token_streaming_equals_batch_and_counts_reasoning(muse, name) -> None:
    tok = muse.tokenizer
    text = (" to=self<|message|>Need Seoul's weather 😀.<|eom|><|start|>assistant to=commentary<|message|>"
            "Checking.<|eom|><|start|>assistant to=get_weather<|message|>"
            + _invoke("get_weather", city="Seoul 🌧", days="3") + "<|eom|>")
    ids = tok.encode(text)
    assert 200022 in ids and 200023 in ids and 200007 in ids
    pipeline = Pipeline(tok, PipelineConfig(request_id="r", reasoning_parser=name, tool_parser=name,
                                            tool_choice="auto", tools=WEATHER, skip_special_tokens=False))
    batch, state = derender_all(pipeline, ids)
    assert stream_fold(pipeline, ids, list(range(1, len(ids)))) == batch
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in batch["tool_calls"]] == [
        ("get_weather", {"city": "Seoul 🌧", "days": 3})]
    assert batch["reasoning"] == "Need Seoul's weather 😀."
    assert batch["content"] == "Checking."  # (muse_glimmer: commentary is a tool message; its text is content)
    assert Pipeline.reasoning_tokens(state) == len(tok.encode("Need Seoul's weather 😀."))


@pytest.mark.slow
def test_without_tools_the_answer_comes_out_clean(muse) -> None:
    # tool_choice none: the reasoning stage's companion still reads the messages, so no markup reaches content
    tok = muse.tokenizer
    text = " to=self<|message|>Easy.<|eom|><|start|>assistant to=user<|message|>Four.<|eot|>"
    pipeline = Pipeline(tok, PipelineConfig(request_id="r", reasoning_parser="muse", skip_special_tokens=False))
    batch, _ = derender_all(pipeline, tok.encode(text))
    assert (batch["reasoning"], batch["content"], batch["tool_calls"]) == ("Easy.", "Four.", [])


@pytest.mark.slow
def test_a_call_cut_by_max_tokens_is_not_handed_out(muse) -> None:
    tok = muse.tokenizer
    done = "<|start|>assistant to=get_time<|message|>" + _invoke("get_time") + "<|eom|>"
    cut = '<|start|>assistant to=get_weather<|message|><atem:function_calls>\n<atem:invoke name="get_weather">\n' \
          '<atem:parameter name="city">Seo'
    pipeline = Pipeline(tok, PipelineConfig(request_id="r", reasoning_parser="muse", tool_parser="muse",
                                            tool_choice="auto", tools=WEATHER, skip_special_tokens=False))
    message, _ = derender_all(pipeline, tok.encode(" to=self<|message|>Two calls.<|eom|>" + done + cut),
                              engine_finish="length")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_time"]
    # the cut call's text is content, its ATEM markup included (the message's header is framing)
    assert message["content"] == cut[cut.index("<atem:"):] and message["reasoning"] == "Two calls."


@pytest.mark.slow
def test_a_named_tool_choice_is_read_in_atem(muse) -> None:
    tok = muse.tokenizer
    text = "<|start|>assistant to=get_weather<|message|>" + _invoke("get_weather", city="Oslo") + "<|eom|>"
    pipeline = Pipeline(tok, PipelineConfig(request_id="r", reasoning_parser="muse", tool_parser="muse",
                                            tool_choice="named", named_function="get_weather", tools=WEATHER,
                                            skip_special_tokens=False))
    message, _ = derender_all(pipeline, tok.encode(text))
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Oslo"})]


@pytest.mark.slow
def test_render_gives_transformers_token_ids_on_every_conversation(tmp_path) -> None:
    pytest.importorskip("transformers")
    from tests.conversations import CONVERSATIONS
    from tests.test_family_templates import _render_both
    from tests.test_templates import Side, _inputs

    side = Side(write_family_bundle("muse_glimmer", tmp_path / "bundle"))
    rendered = 0
    for conv in CONVERSATIONS:
        messages, kwargs = _inputs(conv)
        ours, ref = _render_both(side, messages, kwargs)
        if ours is not None:
            assert ours == ref, conv.name
            rendered += 1
    assert rendered >= 10
