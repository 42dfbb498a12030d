"""Tool-call constraints per tool parser equal vLLM 0.32's and 0.33's, and forced calls in vLLM's shape derender.

What vLLM's render servers put in ``structured_outputs`` (and ``skip_special_tokens``) for every tool parser we
register and every case of tests/vllm_tool_constraints.py (forced and auto tool choice, strict tools, one call,
a response format next to the calls) is recorded in tests/fixtures/vllm_tool_constraints/; our render must
answer the same, byte for byte (a structural tag is compared as the JSON text vLLM writes). Where the peers are
installed (tests/vllm_peers.py), the slow tests ask the live servers again.

gpt-oss (``openai``) runs on the gpt-oss test bundle (render_service/harmony/bundle.py), whose config says
``model_type: gpt_oss`` to vLLM.

Then, per family, a forced call written the way vLLM's constraint makes the model write it: the text is checked to
be in the language of vLLM's recorded constraint by our engine's grammar compiler (xgrammar, as the engine runs
it), and our derender reads it as one call, in batch and one token at a time.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from render_service.bundle.model_bundle import load_bundle
from render_service.derender.batch import pipeline_config
from render_service.harmony.bundle import gpt_oss_bundle_dir
from render_service.parsers.pipeline import MessageAccumulator, Pipeline, derender_all
from render_service.render.render import render_chat
from render_service.render.render_config import build_render_config
from render_service.wire.protocol import ChatCompletionRequest
from tests import vllm_tool_constraints as recorded
from tests.vllm_peers import VLLM032, VLLM033, needs_vllm032, needs_vllm033

VERSIONS = ("0.32", "0.33")
COMPARED = list(recorded.PARSERS)
QWEN3_STOPS = [151645, 151643]
GPT_OSS_STOPS = [200002, 199999, 200012]  # <|return|>, <|endoftext|>, <|call|>


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory) -> Path:
    return recorded.write_tool_parser_bundle(tmp_path_factory.mktemp("tool-parser-bundle") / "m")


@pytest.fixture(scope="module")
def configs(bundle_dir):
    bundles = {"qwen3": load_bundle(str(bundle_dir))}
    cache: dict[tuple[str, str], object] = {}

    def config(parser: str, strict_level: str = "auto"):
        if (parser, strict_level) not in cache:
            if parser == "openai" and "gpt-oss" not in bundles:
                bundles["gpt-oss"] = load_bundle(str(gpt_oss_bundle_dir()))
            cache[parser, strict_level] = build_render_config(
                bundles["gpt-oss" if parser == "openai" else "qwen3"], served_model_names=[recorded.MODEL],
                tool_call_parser=parser, enable_auto_tool_choice=True, tool_strict_level=strict_level)
        return cache[parser, strict_level]

    return config


def differences(config, answers: dict[str, dict]) -> dict[str, tuple[dict, dict]]:
    """case -> (ours, vLLM's) where they differ."""
    out = {}
    for case, theirs in answers.items():
        mine = recorded.our_answer(config, case)
        if mine != theirs:
            out[case] = (mine, theirs)
    return out


# ------------------------------------------------------------------------------------------ recorded


def test_the_recordings_cover_every_parser_and_case():
    for version in VERSIONS:
        recording = recorded.load_recording(version)
        assert recording["vllm"].startswith(version)
        assert list(recording["parsers"]) == list(recorded.PARSERS)
        for answers in recording["parsers"].values():
            assert list(answers) == list(recorded.CASES)
    # 0.33 changed nothing here
    assert recorded.load_recording("0.32")["parsers"] == recorded.load_recording("0.33")["parsers"]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("parser", COMPARED)
def test_render_equals_vllms_recorded_constraints(configs, version, parser):
    answers = recorded.load_recording(version)["parsers"][parser]
    assert differences(configs(parser), answers) == {}


@pytest.mark.parametrize("version", VERSIONS)
def test_server_strict_levels_equal_vllms(configs, version):
    levels = recorded.load_recording(version)["strict_levels"]
    assert {level: sorted(p) for level, p in levels.items()} == {
        level: sorted(p) for level, p in recorded.STRICT_LEVEL_PARSERS.items()}
    for level, parsers in levels.items():
        for parser, answers in parsers.items():
            assert differences(configs(parser, level), answers) == {}, (level, parser)


def test_the_cases_tell_the_families_apart():
    # a test that cannot fail is a defect: the cases must make each family's tags different and exercise both
    # the structural-tag and the JSON paths, the one-call rule and composed formats
    recording = recorded.load_recording("0.32")["parsers"]
    named = {p: json.dumps(recording[p]["named"]["structured_outputs"]) for p in COMPARED}
    # qwen3_coder/xml, llama3/4_json, glm45/47 share a family, and pythonic, seed_oss, llama4_pythonic and granite4
    # vLLM's JSON: 12 different constraints for 18 parsers
    assert len(set(named.values())) == 12
    one_call = recording["qwen3_coder"]["required_one_call"]["structured_outputs"]["structural_tag"]
    assert '"stop_after_first": true' in one_call
    assert '"type": "or"' in recording["glm47"]["auto_strict_regex"]["structured_outputs"]["structural_tag"]
    assert "json" in recording["pythonic"]["required"]["structured_outputs"]


# ------------------------------------------------------------------------------------------ live peers


def _live(configs, venv: Path, parser: str, tmp_path: Path) -> None:
    bundle = recorded.write_tool_parser_bundle(tmp_path / "m")
    answers = recorded.record_parser(venv, parser, bundle, tmp_path)
    assert differences(configs(parser), answers) == {}


@pytest.mark.slow  # one vLLM render server per parser, ~25-60 s each on a shared 2-core machine
@needs_vllm032
@pytest.mark.parametrize("parser", COMPARED)
def test_render_equals_live_vllm_032(configs, parser, tmp_path):
    _live(configs, VLLM032, parser, tmp_path)


@pytest.mark.slow
@needs_vllm033
@pytest.mark.parametrize("parser", COMPARED)
def test_render_equals_live_vllm_033(configs, parser, tmp_path):
    _live(configs, VLLM033, parser, tmp_path)


# ---------------------------------------------------------------------- forced calls in vLLM's shape

ARGS = '{"city": "Oslo", "days": 2}'
DSML = "｜DSML｜"
# parser -> the named call (get_weather with ARGS) as vLLM's constraint has the model write it
NAMED_CALLS = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>',
    "qwen3_coder": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n2\n"
                    "</parameter>\n</function>\n</tool_call>"),
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}',
    "mistral": '[{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}]',
    "deepseek_v31": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>" + ARGS
                     + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    "pythonic": ARGS,
    "kimi_k2": ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
                + ARGS + "<|tool_call_end|><|tool_calls_section_end|>"),
    "glm47": ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value><arg_key>days</arg_key>"
              "<arg_value>2</arg_value></tool_call>"),
    "minimax_m2": ('\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Oslo</parameter>\n'
                   '<parameter name="days">2</parameter>\n</invoke>\n</minimax:tool_call>'),
    "deepseek_v32": (f'\n\n<{DSML}function_calls>\n<{DSML}invoke name="get_weather">\n<{DSML}parameter name="city" '
                     f'string="true">Oslo</{DSML}parameter>\n<{DSML}parameter name="days" string="false">2'
                     f'</{DSML}parameter>\n</{DSML}invoke>\n</{DSML}function_calls>'),
}
NAMED_CALLS |= {"qwen3_xml": NAMED_CALLS["qwen3_coder"], "llama4_json": NAMED_CALLS["llama3_json"],
                "glm45": NAMED_CALLS["glm47"], "seed_oss": ARGS, "llama4_pythonic": ARGS, "granite4": ARGS,
                "deepseek_v4": NAMED_CALLS["deepseek_v32"].replace("function_calls", "tool_calls")}
HARMONY_CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>' + ARGS
# gpt-oss reasons first; its reply is one message (the tag has no list of calls), ended by the <|call|> stop token
NAMED_CALLS["openai"] = "<|channel|>analysis<|message|>Oslo.<|end|><|start|>assistant" + HARMONY_CALL
TIME = '{"name": "get_time", '
# parser -> two calls (get_time, then get_weather with ARGS) for "required"
REQUIRED_CALLS = {
    "hermes": ('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>' + NAMED_CALLS["hermes"]),
    "qwen3_coder": "<tool_call>\n<function=get_time>\n\n</function>\n</tool_call>\n" + NAMED_CALLS["qwen3_coder"],
    "llama3_json": TIME + '"parameters": {}}; ' + NAMED_CALLS["llama3_json"],
    "mistral": '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": ' + ARGS + "}]",
    "deepseek_v31": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
                     "<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>" + ARGS + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    "pythonic": '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": ' + ARGS + "}]",
    "kimi_k2": ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>{}"
                "<|tool_call_end|><|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>" + ARGS
                + "<|tool_call_end|><|tool_calls_section_end|>"),
    "glm47": "<tool_call>get_time</tool_call>" + NAMED_CALLS["glm47"],
    "minimax_m2": ('\n<minimax:tool_call>\n<invoke name="get_time">\n</invoke>\n<invoke name="get_weather">\n'
                   '<parameter name="city">Oslo</parameter>\n<parameter name="days">2</parameter>\n</invoke>\n'
                   '</minimax:tool_call>'),
    "deepseek_v32": NAMED_CALLS["deepseek_v32"].replace(
        f'<{DSML}invoke name="get_weather">', f'<{DSML}invoke name="get_time">\n</{DSML}invoke>\n'
                                             f'<{DSML}invoke name="get_weather">'),
}
REQUIRED_CALLS |= {"qwen3_xml": REQUIRED_CALLS["qwen3_coder"], "llama4_json": REQUIRED_CALLS["llama3_json"],
                   "glm45": REQUIRED_CALLS["glm47"], "seed_oss": REQUIRED_CALLS["pythonic"],
                   "llama4_pythonic": REQUIRED_CALLS["pythonic"], "granite4": REQUIRED_CALLS["pythonic"],
                   "deepseek_v4": REQUIRED_CALLS["deepseek_v32"].replace("function_calls", "tool_calls"),
                   "openai": " to=functions.get_weather<|channel|>commentary json<|message|>" + ARGS}


@pytest.fixture(scope="module")
def grammars(bundle_dir):
    """Our engine's grammar compilers, per parser: the same vocabulary as the render (Qwen3's 151,936 rows;
    gpt-oss's 201,088 for ``openai``, loaded on first use)."""
    from token_engine.structured import GrammarCompiler

    compilers: dict[str, GrammarCompiler] = {}

    def compiler(parser: str) -> tuple[GrammarCompiler, list[int]]:
        key = "gpt-oss" if parser == "openai" else "qwen3"
        if key not in compilers:
            compilers[key] = GrammarCompiler(gpt_oss_bundle_dir(), 201088, GPT_OSS_STOPS) if key == "gpt-oss" \
                else GrammarCompiler(bundle_dir, 151936, QWEN3_STOPS)
        return compilers[key], GPT_OSS_STOPS if key == "gpt-oss" else QWEN3_STOPS

    yield compiler
    for c in compilers.values():
        c.close()


def in_constraint(grammars, parser: str, tokenizer, structured: dict, text: str) -> bool:
    """Whether the engine, holding the output to ``structured``, accepts ``text`` and then a stop token."""
    from token_engine.structured import parse_structured_outputs
    from token_engine.structured.matcher import GrammarState

    compiler, stops = grammars(parser)
    state = GrammarState(compiler.compile(parse_structured_outputs(structured)), stops)
    for token in tokenizer.encode(text):
        state.accept(token)
    state.accept(stops[-1])
    return not state.violated and state.terminated


def derendered(config, req, prompt_ids: list[int], output: str, one_token: bool) -> dict:
    pipeline = Pipeline(config.tokenizer, pipeline_config(config, req, request_id="chatcmpl-1", choice_index=0))
    ids = config.tokenizer.encode(output)
    if not one_token:
        return derender_all(pipeline, ids, prompt_token_ids=prompt_ids)[0]
    state, acc = pipeline.initial_state(prompt_ids), MessageAccumulator()
    for token in ids:  # each chunk after a stream_state round trip
        state = pipeline.restore_state(msgspec.msgpack.decode(msgspec.msgpack.encode(state)))
        acc.add(pipeline.feed(state, [token]))
    acc.add(pipeline.finish(state))
    return acc.message(True)


@pytest.mark.parametrize("choice", ["named", "required"])
@pytest.mark.parametrize("parser", COMPARED)
def test_a_forced_call_in_vllms_shape_derenders(configs, grammars, parser, choice):
    config = configs(parser)
    text = (NAMED_CALLS if choice == "named" else REQUIRED_CALLS)[parser]
    vllms = recorded.load_recording("0.32")["parsers"][parser][choice]["structured_outputs"]
    assert in_constraint(grammars, parser, config.tokenizer, vllms, text), "not what vLLM's constraint allows"
    assert not in_constraint(grammars, parser, config.tokenizer, vllms, "It is sunny in Oslo.")  # the call is forced
    req = msgspec.convert(recorded.body(choice), ChatCompletionRequest)
    prompt_ids = render_chat(req, config).token_ids
    batch = derendered(config, req, prompt_ids, text, one_token=False)
    expected = [{"name": "get_weather", "arguments": ARGS}]
    if choice == "required" and parser != "openai":
        expected.insert(0, {"name": "get_time", "arguments": "{}"})
    assert [c["function"] for c in batch["tool_calls"]] == expected
    assert not batch["content"]
    assert derendered(config, req, prompt_ids, text, one_token=True) == batch


def test_a_gpt_oss_json_answer_in_vllms_shape_derenders(configs, grammars):
    # a response format on gpt-oss: the reply may reason, then it is the final message, announced as JSON
    config = configs("openai")
    vllms = recorded.load_recording("0.32")["parsers"]["openai"]["auto_json_object"]["structured_outputs"]
    text = '<|channel|>analysis<|message|>JSON.<|end|><|start|>assistant<|channel|>final <|constrain|>json<|message|>{"a": 1}'
    assert in_constraint(grammars, "openai", config.tokenizer, vllms, text)
    assert not in_constraint(grammars, "openai", config.tokenizer, vllms, HARMONY_CALL)
    req = msgspec.convert(recorded.body("auto_json_object"), ChatCompletionRequest)
    prompt_ids = render_chat(req, config).token_ids
    batch = derendered(config, req, prompt_ids, text, one_token=False)
    assert (batch["reasoning"], batch["content"], batch["tool_calls"]) == ("JSON.", '{"a": 1}', [])
    assert derendered(config, req, prompt_ids, text, one_token=True) == batch


# a structural tag in its legacy form, and what vLLM 0.32/0.33 make of it (structured_outputs_to_format, run in
# each peer): triggered tags
LEGACY_TAG = {"type": "structural_tag", "triggers": ["<f="],
              "structures": [{"begin": "<f=a>", "schema": {"type": "object"}, "end": "</f>"}]}
LEGACY_AS_VLLM = {"type": "triggered_tags", "triggers": ["<f="], "tags": [
    {"type": "tag", "begin": "<f=a>", "content": {"type": "json_schema", "json_schema": {"type": "object"},
                                                 "style": "json", "any_order": False, "max_whitespace_cnt": None,
                                                 "excludes": []}, "end": "</f>"}],
    "at_least_one": False, "stop_after_first": False, "excludes": []}


def test_a_legacy_structural_tag_is_converted_as_vllm_and_compiles(configs, grammars):
    from token_engine.structured import parse_structured_outputs

    strict_auto = {**recorded.body("auto_strict"), "structured_outputs": {"structural_tag": json.dumps(LEGACY_TAG)}}
    for parser in ("hermes", "openai"):  # or-ed with a strict tool's calls; gpt-oss: also its Harmony answer
        structured = render_chat(msgspec.convert(strict_auto, ChatCompletionRequest), configs(parser)) \
            .sampling_params.structured_outputs
        fmt = json.loads(structured["structural_tag"])["format"]
        assert json.dumps(LEGACY_AS_VLLM) in json.dumps(fmt)
        grammars(parser)[0].compile(parse_structured_outputs(structured))  # a GrammarError fails the test


@pytest.mark.parametrize("parser", ["hermes", "qwen3_xml", "llama3_json", "mistral", "kimi_k2", "glm47",
                                    "deepseek_v4"])
def test_our_earlier_json_shapes_still_derender(configs, parser):
    # what our render constrained forced calls to before following vLLM per parser: the arguments object (named)
    # and an array of {"name", "parameters"} ("required"); a request rendered then may derender now
    config = configs(parser)
    for choice, text, expected in (
            ("named", "  " + ARGS, [{"name": "get_weather", "arguments": ARGS}]),
            ("required", '[{"name": "get_weather", "parameters": ' + ARGS + "}]",
             [{"name": "get_weather", "arguments": ARGS}])):
        req = msgspec.convert(recorded.body(choice), ChatCompletionRequest)
        prompt_ids = render_chat(req, config).token_ids
        batch = derendered(config, req, prompt_ids, text, one_token=False)
        assert [c["function"] for c in batch["tool_calls"]] == expected, (choice, batch)
        assert derendered(config, req, prompt_ids, text, one_token=True) == batch


def test_a_llama_named_call_cut_inside_its_opening_is_still_vllms_shape(configs):
    # the opening '{"name": "get_weather", "parameters": ' is held until it decides the shape; a stream cut
    # inside it (max_tokens) ends as the family parser reads it, not as arguments text
    config = configs("llama3_json")
    req = msgspec.convert(recorded.body("named"), ChatCompletionRequest)
    prompt_ids = render_chat(req, config).token_ids
    batch = derendered(config, req, prompt_ids, '{"name": "get_wea', one_token=False)
    assert all(c["function"]["arguments"] != '{"name": "get_wea' for c in batch["tool_calls"])
    assert derendered(config, req, prompt_ids, '{"name": "get_wea', one_token=True) == batch


# the cases whose constraints hold the node kinds the "named"/"required" ones above do not (schemas of every
# kind, GLM's per-key tags, regex, choice and grammar next to the calls, one-call limits)
COMPILED_CASES = ("required_shapes", "required_shapes_strict", "auto_strict_regex", "auto_strict_choice",
                  "auto_strict_grammar", "auto_json_object", "auto_one_call")


@pytest.mark.slow  # ~10-15 s of compiles on a shared 2-core machine (the forced-call tests above compile theirs)
def test_our_engine_compiles_the_constraints_render_writes(configs, grammars):
    from token_engine.structured import parse_structured_outputs

    seen: set[str] = set()
    for parser in COMPARED:
        for case in COMPILED_CASES:
            structured = recorded.our_answer(configs(parser), case).get("structured_outputs")
            key = json.dumps(structured, sort_keys=True)
            if structured is None or key in seen:
                continue
            seen.add(key)
            grammars(parser)[0].compile(parse_structured_outputs(structured))  # a GrammarError fails the test
    assert len(seen) > 40
